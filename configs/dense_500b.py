r"""A ~500B-parameter dense decoder (Llama-style) on 1024 TPU v4 chips.

496.3B parameters: 100 scanned blocks, d_model 20480, 160 query heads of 128
over 16 key/value heads, SwiGLU 65536, untied embeddings; mesh fsdp=128 x
tensor=8 on a v4:8x8x16 slice, global batch 256 x 2048 tokens. The paper (Wang
et al., ASPLOS 2023) reports 72% of peak FLOPS for a 500B model on 1024 TPU v4
chips. Nothing here runs on a CPU; compile it for the slice ahead of time (the
tpu extra) for memory fit and the modeled step of each variant:

  python -m launch.aot --config configs/dense_500b.py --topology v4:8x8x16

Its figures, and what each setting below gave: docs/benchmarks.md, docs/paper_scale.md.
"""

import ml_collections

from configs import paper_base


def get_config() -> ml_collections.ConfigDict:
  c = paper_base.get_config()  # bf16 on fp32 weights, scan, splash, fused projections, v4
  c.batch_size = 256               # sequences: 2 per fsdp shard
  c.seq_len = 2048
  c.model.d_model = 20480
  c.model.num_layers = 100
  c.model.num_heads = 160
  c.model.num_kv_heads = 16
  c.model.mlp_dim = 65536
  c.model.remat = 'minimal'        # every projection's output kept
  c.model.scan_unroll = 2          # the next layer's weight gathers overlap this one's backward
  c.model.cast_in_loop = True      # no bf16 copy of all layers' weights: the fit needs it
  c.optimizer.learning_rate = 1e-4
  c.optimizer.mu_dtype = 'bfloat16'  # both moments in bf16 (as DeepSeek-V3): the memory
  c.optimizer.nu_dtype = 'bfloat16'  # the rings' buffers need; master weights fp32
  c.mesh.data = 1
  c.mesh.fsdp = 128
  c.mesh.tensor = 8                # each ring step's einsum wide enough to hide its transfer
  # The chip's flags, then XLA's pipelining of a scanned layer's all-gathers and
  # reduce-scatters over ICI into the iteration before (after), as MaxText's recipes.
  c.hardware.xla_flags = ('default --xla_tpu_enable_ici_ag_pipelining=true '
                          '--xla_tpu_enable_ici_rs_pipelining=true')
  c.aot.topology = 'v4:8x8x16'
  return c
