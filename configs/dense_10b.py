r"""A ~10B-parameter dense decoder (Llama-style) on 128 TPU v4 chips.

9.90B parameters: 32 scanned blocks, d_model 5120, 40 query heads of 128 over 8
key/value heads, SwiGLU 15360, untied embeddings; mesh data=4 x fsdp=32 on a
v4:4x4x8 slice (Cloud TPU accelerator type v4-256: 128 chips, 32 hosts), global
batch 256 x 2048 tokens. The smallest of the paper's model sizes (Wang et al.,
ASPLOS 2023: 10B to 1T parameters).

The layout is the layout search's best (`python -m launch.aot --config
configs/dense_10b.py --search`). It has no tensor axis, so there is nothing for
the rings to decompose: at 10B on 128 chips, FSDP plus data parallelism beats
tensor parallelism. Nothing here runs on a CPU; compile it for the slice ahead
of time (the tpu extra) for memory fit and the modeled step of each variant:

  python -m launch.aot --config configs/dense_10b.py --topology v4:4x4x8

Its figures, and what each setting below gave: docs/benchmarks.md, docs/paper_scale.md.
"""

import ml_collections

from configs import paper_base


def get_config() -> ml_collections.ConfigDict:
  c = paper_base.get_config()  # bf16 on fp32 weights, scan, splash, fused projections, v4
  c.batch_size = 256
  c.seq_len = 2048
  c.model.d_model = 5120
  c.model.num_layers = 32
  c.model.num_heads = 40
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 15360
  c.model.remat = 'minimal'        # projection outputs kept
  c.optimizer.learning_rate = 3e-4
  c.mesh.data = 4
  c.mesh.fsdp = 32
  c.mesh.tensor = 1
  c.aot.topology = 'v4:4x4x8'
  return c
