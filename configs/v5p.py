r"""The four paper configs on TPU v5p slices of the same chip counts.

  python -m launch.aot --config configs/v5p.py:dense_500b

The argument names ``configs/dense_10b.py``, ``dense_64b.py``, ``dense_500b.py``
or ``moe_1t.py``: that model on a v5p slice of as many chips (``SLICES``), modeled
with ``parallelism/hardware.py``'s ``tpu_v5p`` row, at the layout ``LAYOUTS`` names
(v5p's memory holds more per chip than v4's, so each is searched on v5p). Figures,
and what each setting gave: docs/benchmarks.md, docs/paper_scale.md.
"""

import importlib

import ml_collections

from configs import paper_base

SLICES = {'dense_10b': 'v5p:4x4x8', 'dense_64b': 'v5p:8x8x8', 'dense_500b': 'v5p:8x8x16',
          'moe_1t': 'v5p:8x8x16'}

# Each model's best compiled layout on its slice: the dense three's from the layout search
# (``launch.aot --config configs/v5p.py:<name> --search``), ``moe_1t``'s (its expert axis
# unswept) the best of its remat and twice its batch. MaxText's continuation-fusion flags
# for all-reduce (``CF_FOR_ALL_REDUCE``) let some baselines' all-reduces run asynchronously.
ALL_REDUCE_FLAGS = ('default --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true '
                    '--xla_enable_async_all_reduce=true')
LAYOUTS = {
    'dense_10b': {'batch_size': 512, 'model.remat': 'save_dot_except_qkv'},
    # No tensor axis: the blocks' weight gradients ring over fsdp beside the compiler's
    # forward einsums, where its reduce-scatters would block.
    'dense_64b': {'mesh.data': 8, 'mesh.fsdp': 64, 'mesh.tensor': 1, 'batch_size': 1024,
                  'model.remat': 'minimal', 'hardware.xla_flags': ALL_REDUCE_FLAGS,
                  'parallelism.layer_overrides': 'blocks.*=gradients', 'parallelism.plan': ''},
    # Without the scan and optimizer settings v4's memory needs.
    'dense_500b': {'batch_size': 512, 'model.remat': 'minimal', 'model.scan_unroll': 1,
                   'model.cast_in_loop': False,
                   'optimizer.mu_dtype': 'param', 'optimizer.nu_dtype': 'param'},
    'moe_1t': {'batch_size': 2048, 'model.remat': 'minimal',
               'hardware.xla_flags': ALL_REDUCE_FLAGS,
               'parallelism.plan': paper_base.plan_path('v5p_moe_1t')},
}
# A plan file is one layout's (configs/plans/README.md): v4's are not read on v5p.


def get_config(name: str = 'dense_500b') -> ml_collections.ConfigDict:
  if name not in SLICES:
    raise ValueError(f'the argument is one of {sorted(SLICES)}')  # the loader names it
  c = importlib.import_module(f'configs.{name}').get_config()
  c.update_from_flattened_dict(LAYOUTS[name])
  c.hardware.name = 'tpu_v5p'
  c.aot.topology = SLICES[name]
  return c
