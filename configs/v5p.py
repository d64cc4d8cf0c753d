r"""The four paper configs on TPU v5p slices of the same chip counts.

  python -m launch.aot --config configs/v5p.py:dense_500b

The argument names one of ``configs/dense_10b.py``, ``dense_64b.py``,
``dense_500b.py`` and ``moe_1t.py``: the same model and settings, compiled for
a v5p slice of as many chips (``v5p:4x4x8``: 128, ``v5p:8x8x8``: 512,
``v5p:8x8x16``: 1024; 3-D tori like v4's) and modeled with the ``tpu_v5p`` row
of ``parallelism/hardware.py`` (459 TFLOP/s, 2.77 TB/s of HBM, 90 GB/s links,
95.74 GiB usable per program), at the layout ``LAYOUTS`` names: v5p's memory
holds more tokens per chip and more saved activations than v4's 30.75 GiB, so
each layout is searched on its v5p slice rather than taken from v4.

The modeled seconds in the comments below compare layouts and settings with one
another; they were modeled before the step model's calibration refits of
2026-12-04 (matmuls then at the data sheet's peak, now at 87% of it).
Today's figures for this config: docs/benchmarks.md.
"""

import importlib

import ml_collections

SLICES = {'dense_10b': 'v5p:4x4x8', 'dense_64b': 'v5p:8x8x8', 'dense_500b': 'v5p:8x8x16',
          'moe_1t': 'v5p:8x8x16'}

# Each model's best compiled layout on its v5p slice, modeled (docs/paper_scale.md has the
# tables): for the dense three the layout search's (``python -m launch.aot --config
# configs/v5p.py:<name> --search``, run from v4's layouts, so at most twice v4's tokens
# per step); for ``moe_1t``, whose expert axis the search does not sweep, the best of its
# remat and twice its batch, compiled by hand. The 64B is fastest with no tensor axis on
# v5p. MaxText's continuation-fusion flags for all-reduce (its ``CF_FOR_ALL_REDUCE``)
# make the baselines of the 64B and ``moe_1t`` faster (some of their all-reduces run
# asynchronously) and change neither the 500B nor the 10B; on v4 the baselines run out
# of VMEM with them. With no tensor axis, the 64B's forward einsums are the compiler's;
# its weight gradients ring over fsdp beside them (``parallelism.gradient_rings``), as
# the compiler's reduce-scatters of them block (docs/paper_scale.md).
ALL_REDUCE_FLAGS = ('default --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true '
                    '--xla_enable_async_all_reduce=true')
LAYOUTS = {
    'dense_10b': {'batch_size': 512, 'model.remat': 'save_dot_except_qkv'},
    'dense_64b': {'mesh.data': 8, 'mesh.fsdp': 64, 'mesh.tensor': 1, 'batch_size': 1024,
                  'model.remat': 'minimal', 'hardware.xla_flags': ALL_REDUCE_FLAGS,
                  'parallelism.gradient_rings': 'any_forward',
                  # v4's plain attn.o and pairs apart are for its rings over tensor
                  'parallelism.plain_layers': '', 'parallelism.gather_pairs': 'joined',
                  # its weight gradients' two-way rings over fsdp a Pallas kernel a round
                  # (parallelism/pair_sums.py): ours 4.778 -> 4.511 s, compute 1.054x ->
                  # 1.015x the baseline's (modeled)
                  'parallelism.ring_additions': 'kernel'},
    # v4's casts in the scan, two layers an iteration, sharded gradient accumulators and
    # bf16 moments are for v4's memory; this layout was searched and measured without
    # them (its ring settings, v4's too: ours 9.001 -> 8.819 s, modeled; 8.871 s since the
    # all-gather rings wait for each round's einsum; 8.777 s with v4's ring schedule and
    # accumulators' layout; 8.643 s with v4's one-way rings' additions fused in halves,
    # 8.665 s with its two-way activation rings' too; 8.660 s with its two-way all-gather
    # rings an einsum a block)
    'dense_500b': {'batch_size': 512, 'model.remat': 'minimal', 'model.scan_unroll': 1,
                   'model.cast_in_loop': False, 'parallelism.gradient_accumulators': 'any',
                   'optimizer.mu_dtype': 'param', 'optimizer.nu_dtype': 'param'},
    'moe_1t': {'batch_size': 2048, 'model.remat': 'minimal',
               'hardware.xla_flags': ALL_REDUCE_FLAGS},
}


def get_config(name: str = 'dense_500b') -> ml_collections.ConfigDict:
  if name not in SLICES:
    raise ValueError(f'the argument is one of {sorted(SLICES)}')  # the loader names it
  c = importlib.import_module(f'configs.{name}').get_config()
  c.update_from_flattened_dict(LAYOUTS[name])
  c.hardware.name = 'tpu_v5p'
  c.aot.topology = SLICES[name]
  return c
