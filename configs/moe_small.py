r"""A small Mixture-of-Experts LM with expert parallelism on 8 CPU devices.

  python -m trainer.train --config configs/moe_small.py --workdir runs/moe_small

The default model with every second MLP replaced by 8 SwiGLU experts (top-2,
capacity factor 1.25), on mesh data=2 x expert=4: each device holds 2 experts
and a quarter of each data shard's sequences, and tokens reach their experts
through an all-to-all over `expert`, decomposed into `moe.overlap_chunks`
chunks (parallelism.collective_matmul='always'; see parallelism/moe.py).
Expert load, dropped tokens and the aux losses go to metrics.jsonl.
"""

from configs import default


def get_config():
  c = default.get_config()
  c.steps = 200
  c.moe.num_experts = 8
  c.moe.top_k = 2
  c.moe.every = 2
  c.moe.mlp_dim = 512
  c.mesh.data = 2
  c.mesh.tensor = 1
  c.mesh.expert = 4
  # Tokens are sharded over expert too (expert last, so one all-to-all moves
  # them to their experts); the second batch rule is their layout at the experts.
  c.mesh.logical_axis_rules = [
      ['batch', ['data', 'fsdp', 'expert']],
      ['batch', ['data', 'fsdp']],
      ['exp', 'expert'],
      ['residual_length', 'tensor'],
      ['vocab', 'tensor'],
      ['embed', 'fsdp'],
      ['mlp', 'tensor'],
      ['heads', 'tensor'],
      ['kv_heads', 'tensor'],
  ]
  return c
