r"""A ~64B-parameter dense decoder (Llama-style) on 512 TPU v4 chips.

63.96B parameters: 80 scanned blocks, d_model 8192, 64 query heads of 128 over
8 key/value heads, SwiGLU 26112, untied embeddings; mesh fsdp=64 x tensor=8 on
a v4:8x8x8 slice, global batch 512 x 2048 tokens: ours' best layout by the layout
search (python -m launch.aot --config configs/dense_64b.py --search); the baseline
and xla do better without a tensor axis (configs/comparators.py, docs/results.md).
Nothing here runs on a CPU; compile it for the slice ahead of time (the tpu
extra) for memory fit and the modeled step of each variant:

  python -m launch.aot --config configs/dense_64b.py --topology v4:8x8x8

Its figures, and what each setting below gave: docs/benchmarks.md, docs/paper_scale.md.
"""

import ml_collections

from configs import paper_base


def get_config() -> ml_collections.ConfigDict:
  c = paper_base.get_config()  # bf16 on fp32 weights, scan, splash, fused projections, v4
  c.batch_size = 512               # 8 sequences per fsdp shard
  c.seq_len = 2048
  c.model.d_model = 8192
  c.model.num_layers = 80
  c.model.num_heads = 64
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 26112
  c.model.remat = 'minimal'        # every projection's output kept: fits at 64B, no MLP rerun
  c.optimizer.learning_rate = 1.5e-4
  c.parallelism.plan = paper_base.plan_path('dense_64b')  # launch.aot --tune's (configs/plans/)
  c.mesh.data = 1
  c.mesh.fsdp = 64
  c.mesh.tensor = 8
  c.aot.topology = 'v4:8x8x8'
  return c
