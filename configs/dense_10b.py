r"""A ~10B-parameter dense decoder (Llama-style) on 128 TPU v4 chips.

9.90B parameters: 32 scanned blocks, d_model 5120, 40 query heads of 128 over
8 key/value heads, SwiGLU 15360, vocabulary 32768, untied embeddings. Mesh
fsdp=32 x tensor=4 on a v4:4x4x8 slice, global batch 256 x 2048 tokens, bf16
compute over fp32 master weights and AdamW state, full remat. The smallest of
the paper's model sizes (Wang et al., ASPLOS 2023: 10B to 1T parameters).

Nothing here runs on this machine's CPU; compile it for the TPU slice ahead of
time (needs the tpu extra) and read memory fit and the modeled step time:

  python -m launch.aot --config configs/dense_10b.py --topology v4:4x4x8
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.steps = 100_000            # the LR schedule's length (AOT compiles one step)
  c.batch_size = 256           # sequences: 8 per fsdp shard
  c.seq_len = 2048
  c.log_every = 10
  c.eval_every = 1000
  c.eval_steps = 8

  c.model.vocab_size = 32768
  c.model.d_model = 5120
  c.model.num_layers = 32
  c.model.num_heads = 40
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 15360
  c.model.max_seq_len = 2048
  c.model.norm_eps = 1e-5
  c.model.dtype = 'bfloat16'       # compute
  c.model.param_dtype = 'float32'  # master weights (and AdamW moments)
  c.model.scan_layers = True       # one compiled block, not 32
  c.model.remat = 'full'           # keep only each block's input for the backward pass

  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  c.optimizer.weight_decay = 0.1

  c.data.path = 'synthetic'        # point at real tokens (.npy/.bin) to train

  c.mesh.data = 1
  c.mesh.fsdp = 32
  c.mesh.tensor = 4

  # 'auto': the cost model (tpu_v4 profile) decides per layer.
  c.parallelism.collective_matmul = 'auto'

  c.hardware.name = 'tpu_v4'

  c.aot = ml_collections.ConfigDict()
  c.aot.topology = 'v4:4x4x8'      # the slice launch.aot compiles for (--topology overrides)
  return c
