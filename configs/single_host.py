r"""A 76M-parameter byte-level LM on enwik8, for one accelerator host.

A TPU VM (v4-8: 4 chips, v5e-8: 8 chips) or a GPU box (1 to 8 H100/H200):
d_model 768, 12 layers, 12 query heads of 64 over 4 key/value heads, SwiGLU
2048, bytes as tokens, sequences of 2048 bytes, batch 32. bf16 compute over
fp32 master weights and AdamW state, fully sharded over every chip of the host
(mesh fsdp=-1). hardware.name and model.attention are 'auto': the chip's profile
(MFU, cost model, compiler flags) and cuDNN flash attention on a GPU, the splash
attention kernel on a TPU (models/attention.py).

Data: enwik8, the first 10^8 bytes of an English Wikipedia XML dump (the Hutter
Prize corpus, http://mattmahoney.net/dc/textdata.html), one document. Its last
5 MB are held out (the usual enwik8 test split), so eval_bpb is its bits per
character. Download it, then train (README.md, "Quick starts on accelerators"):

  mkdir -p data && curl -sSL -o data/enwik8.zip http://mattmahoney.net/dc/enwik8.zip \
      && unzip -o -d data data/enwik8.zip
  python -m trainer.train --config configs/single_host.py --workdir runs/enwik8
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.steps = 20_000
  c.batch_size = 32             # divisible by 1, 2, 4 and 8 chips
  c.seq_len = 2048
  c.log_every = 50
  c.eval_every = 1000
  c.eval_steps = 16             # 16 x 32 x 2048 bytes of the held-out 5 MB

  c.model.d_model = 768
  c.model.num_layers = 12
  c.model.num_heads = 12
  c.model.num_kv_heads = 4
  c.model.head_dim = 64
  c.model.mlp_dim = 2048
  c.model.max_seq_len = 2048
  c.model.dtype = 'bfloat16'     # compute
  c.model.param_dtype = 'float32'
  c.model.attention = 'auto'     # cudnn on a GPU, splash on a TPU

  c.optimizer.learning_rate = 6e-4
  c.optimizer.warmup_steps = 1000

  c.data.path = 'data/enwik8'
  c.data.eval_fraction = 0.05    # the last 5,000,000 bytes

  c.mesh.data = 1
  c.mesh.fsdp = -1               # every chip of the host
  c.mesh.tensor = 1              # (the default rules' tensor axes are then no-ops)
  c.parallelism.collective_matmul = 'auto'  # the cost model decides, with the chip's profile

  c.checkpoint.every = 1000
  return c
