r"""A ~64B-parameter dense decoder (Llama-style) on 512 TPU v4 chips.

63.96B parameters: 80 scanned blocks, d_model 8192, 64 query heads of 128 over
8 key/value heads, SwiGLU 26112, vocabulary 32768, untied embeddings. Mesh
fsdp=64 x tensor=8 on a v4:8x8x8 slice, global batch 512 x 2048 tokens (the
layout search's best for every variant: python -m launch.aot --config
configs/dense_64b.py --search), bf16 compute over fp32 master weights and AdamW
state, remat minimal (every projection's output kept; baseline and ours both
faster than with save_dot_except_mlp, docs/paper_scale.md), one layer per scan
iteration (both faster than with two).

Nothing here runs on this machine's CPU; compile it for the TPU slice ahead of
time (needs the tpu extra) and read memory fit and the modeled step time:

  python -m launch.aot --config configs/dense_64b.py --topology v4:8x8x8

The modeled seconds in the comments below compare layouts and settings with one
another; they were modeled before the step model's calibration refits of
2026-12-04 (matmuls then at the data sheet's peak, now at 87% of it).
Today's figures for this config: docs/benchmarks.md.
"""

import ml_collections

from configs import dense_500b


def get_config() -> ml_collections.ConfigDict:
  c = dense_500b.get_config()  # bf16 compute, scan, optimizer, tpu_v4
  c.batch_size = 512               # 8 sequences per fsdp shard (256: ours 60.7% modeled MFU)
  c.model.d_model = 8192
  c.model.num_layers = 80
  c.model.num_heads = 64
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 26112
  c.optimizer.learning_rate = 1.5e-4
  c.model.remat = 'minimal'        # fits at 64B, and no recomputed MLP (500B: does not fit)
  c.model.scan_unroll = 1          # two layers per iteration: ours 2.417 s, baseline 2.628 s
  c.model.cast_in_loop = False     # dense_500b's casts in the scan are for its layout
  c.mesh.fsdp = 64
  c.mesh.tensor = 8
  # Rings over tensor=8 run with no loop, every step its own ops (modeled, ours: 4.317 s;
  # before the halved opposite blocks 4.473 s, against 4.649 s with two steps per loop
  # iteration and 4.906 s with one).
  c.parallelism.unroll = 8
  c.parallelism.gradient_accumulators = 'any'  # dense_500b's 'sharded' is for its memory
  # dense_500b's bf16 moments, ring steps, block layout and ring schedule are for its
  # memory and layout
  c.optimizer.mu_dtype = 'param'
  c.optimizer.nu_dtype = 'param'
  c.parallelism.block_layout = 'compiler'
  c.parallelism.last_contribution = 'fused'
  c.parallelism.weight_gradient_gather = 'beside'
  # The 500B's additions fused in halves pay here too (modeled, v4: ours 4.702 -> 4.573 s;
  # additions 0.155 -> 0 s; 4.649 s with the one-way rings' alone).
  c.parallelism.ring_additions = 'fused'
  # attn.o left plain (its forward ring was link-bound: 0.147 s a step exposed of its
  # 0.420 s of transfers) and two-way all-gather rings an einsum a block (no copies of
  # each round's pair): ours' compute within 5% of the baseline's, 3.818 s against the
  # 3.828 s it allows (modeled, v4), the step 4.570 s; with attn.o ringed and the pairs
  # joined, 3.866 s (1.060x) and 4.549 s (docs/paper_scale.md).
  c.parallelism.plain_layers = 'blocks.*.attn.o'
  c.parallelism.gather_pairs = 'apart'
  # The chip's flags only: the 500B's ICI pipelining makes both slower here (modeled:
  # baseline 5.019 -> 5.103 s, ours 4.649 -> 4.671 s with two ring steps per iteration).
  c.hardware.xla_flags = 'default'
  c.aot.topology = 'v4:8x8x8'      # the slice launch.aot compiles for (--topology overrides)
  return c
