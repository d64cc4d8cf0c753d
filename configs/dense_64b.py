r"""A ~64B-parameter dense decoder (Llama-style) on 512 TPU v4 chips.

63.96B parameters: 80 scanned blocks, d_model 8192, 64 query heads of 128 over
8 key/value heads, SwiGLU 26112, vocabulary 32768, untied embeddings. Mesh
fsdp=64 x tensor=8 on a v4:8x8x8 slice, global batch 256 x 2048 tokens, bf16
compute over fp32 master weights and AdamW state, full remat.

Nothing here runs on this machine's CPU; compile it for the TPU slice ahead of
time (needs the tpu extra) and read memory fit and the modeled step time:

  python -m launch.aot --config configs/dense_64b.py --topology v4:8x8x8
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.steps = 100_000            # the LR schedule's length (AOT compiles one step)
  c.batch_size = 256           # sequences: 4 per fsdp shard
  c.seq_len = 2048
  c.log_every = 10
  c.eval_every = 1000
  c.eval_steps = 8

  c.model.vocab_size = 32768
  c.model.d_model = 8192
  c.model.num_layers = 80
  c.model.num_heads = 64
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 26112
  c.model.max_seq_len = 2048
  c.model.norm_eps = 1e-5
  c.model.dtype = 'bfloat16'       # compute
  c.model.param_dtype = 'float32'  # master weights (and AdamW moments)
  c.model.scan_layers = True       # one compiled block, not 80
  c.model.remat = 'full'           # keep only each block's input for the backward pass

  c.optimizer.learning_rate = 1.5e-4
  c.optimizer.warmup_steps = 2000
  c.optimizer.weight_decay = 0.1

  c.data.path = 'synthetic'        # point at real tokens (.npy/.bin) to train

  c.mesh.data = 1
  c.mesh.fsdp = 64
  c.mesh.tensor = 8

  # 'auto': the cost model (tpu_v4 profile) decides per layer.
  c.parallelism.collective_matmul = 'auto'

  c.hardware.name = 'tpu_v4'

  c.aot = ml_collections.ConfigDict()
  c.aot.topology = 'v4:8x8x8'      # the slice launch.aot compiles for (--topology overrides)
  return c
