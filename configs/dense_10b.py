r"""A ~10B-parameter dense decoder (Llama-style) on 128 TPU v4 chips.

9.90B parameters: 32 scanned blocks, d_model 5120, 40 query heads of 128 over
8 key/value heads, SwiGLU 15360, vocabulary 32768, untied embeddings. Mesh
data=4 x fsdp=32 on a v4:4x4x8 slice (Cloud TPU accelerator type v4-256: 128
chips, 32 hosts), global batch 256 x 2048 tokens, bf16 compute over fp32 master
weights and AdamW state, remat 'minimal' (projection outputs kept). The smallest
of the paper's model sizes (Wang et al., ASPLOS 2023: 10B to 1T parameters).

The layout is the layout search's best (`python -m launch.aot --config
configs/dense_10b.py --search`): 67.2% modeled MFU for every variant (`python -m
benchmarks.report --only aot --configs dense_10b`, docs/benchmarks.md). When the
search chose it, before the step model's nested-slice fix, it modeled 63.4%,
against 55.1% for ours at the earlier fsdp=32 x tensor=4 with full remat; those
were not re-run (docs/paper_scale.md). It has no tensor axis, so there is
nothing for the rings to decompose: at 10B on 128 chips, FSDP plus data
parallelism beats tensor parallelism (docs/paper_scale.md).

Nothing here runs on this machine's CPU; compile it for the TPU slice ahead of
time (needs the tpu extra) and read memory fit and the modeled step time:

  python -m launch.aot --config configs/dense_10b.py --topology v4:4x4x8

The modeled seconds in the comments below compare layouts and settings with one
another; they were modeled before the step model's calibration refits of
2026-12-04 (matmuls then at the data sheet's peak, now at 87% of it).
Today's figures for this config: docs/benchmarks.md.
"""

import ml_collections

from configs import dense_500b


def get_config() -> ml_collections.ConfigDict:
  c = dense_500b.get_config()  # batch, bf16 compute, scan, optimizer, tpu_v4
  c.model.d_model = 5120
  c.model.num_layers = 32
  c.model.num_heads = 40
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 15360
  c.optimizer.learning_rate = 3e-4
  c.mesh.data = 4
  c.mesh.fsdp = 32
  c.mesh.tensor = 1
  c.model.remat = 'minimal'
  c.model.scan_unroll = 1  # two layers per iteration: 1.257 s per step against 1.210 (modeled)
  c.model.cast_in_loop = False     # dense_500b's casts in the scan are for its layout
  c.parallelism.gradient_accumulators = 'any'  # dense_500b's 'sharded' is for its memory
  c.parallelism.unroll = 1
  # dense_500b's bf16 moments, ring steps, block layout and ring schedule are for its
  # memory and layout
  c.optimizer.mu_dtype = 'param'
  c.optimizer.nu_dtype = 'param'
  c.parallelism.block_layout = 'compiler'
  c.parallelism.last_contribution = 'fused'
  c.parallelism.weight_gradient_gather = 'beside'
  c.parallelism.ring_additions = 'apart'
  c.parallelism.gather_pairs = 'joined'
  c.hardware.xla_flags = 'default'  # the chip's flags only (not the 500B's ICI pipelining)
  c.aot.topology = 'v4:4x4x8'      # the slice launch.aot compiles for (--topology overrides)
  return c
