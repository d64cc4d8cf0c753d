r"""A ~1T-parameter Mixture-of-Experts decoder on 1024 TPU v4 chips.

About 1.015T parameters, 66B of them multiplied per token: 64 scanned blocks,
d_model 8192, 64 query heads of 128 over 8 key/value heads; every second block's
MLP is 64 SwiGLU experts of width 19456 (top-2, capacity factor 1.25), the
others dense SwiGLU 32768; vocabulary 32768. Mesh fsdp=16 x expert=64 on a
v4:8x8x16 slice: each expert lives on one expert-axis slice, sharded 16 ways
over fsdp; dense weights are sharded over both axes. Global batch 1024 x 1024
tokens, bf16 compute over fp32 master weights and AdamW state, full remat, the
expert all-to-all in 2 chunks.

Nothing here runs on this machine's CPU; compile it for the TPU slice ahead of
time (needs the tpu extra):

  python -m launch.aot --config configs/moe_1t.py --topology v4:8x8x16
"""

import ml_collections

from configs import dense_500b


def get_config() -> ml_collections.ConfigDict:
  c = dense_500b.get_config()  # bf16 compute, scan, remat, optimizer, tpu_v4
  c.batch_size = 1024
  c.seq_len = 1024

  c.model.d_model = 8192
  c.model.num_layers = 64
  c.model.num_heads = 64
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 32768

  c.moe.num_experts = 64
  c.moe.top_k = 2
  c.moe.every = 2
  c.moe.mlp_dim = 19456
  c.moe.capacity_factor = 1.25
  c.moe.overlap_chunks = 2

  c.mesh.data = 1
  c.mesh.fsdp = 16
  c.mesh.tensor = 1
  c.mesh.expert = 64
  # Tokens over every axis (expert last: one all-to-all reaches the experts);
  # expert weights: exp over expert, embed over fsdp; dense weights over both.
  c.mesh.logical_axis_rules = [
      ['batch', ['data', 'fsdp', 'expert']],
      ['batch', ['data', 'fsdp']],
      ['exp', 'expert'],
      ['embed', ['fsdp', 'expert']],
      ['embed', 'fsdp'],
      ['vocab', 'tensor'],
      ['mlp', 'tensor'],
      ['heads', 'tensor'],
      ['kv_heads', 'tensor'],
  ]
  return c
