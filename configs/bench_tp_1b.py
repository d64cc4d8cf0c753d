r"""Benchmark shapes: one Transformer layer of a 1B-class model, tensor-parallel.

d_model 2048, MLP 8192, 16 heads of 128, on 8 CPU devices as data=2 x tensor=4,
4 x 1024 tokens per step: every device of a tensor-parallel group works on
2048 tokens. Used by `python -m benchmarks.train_step`; trainable too:

  python -m trainer.train --config configs/bench_tp_1b.py --config.steps=3
"""

from configs import default


def get_config():
  c = default.get_config()
  c.steps = 10
  c.batch_size = 4
  c.seq_len = 1024
  c.log_every = 1
  c.eval_every = 0
  c.eval_steps = 1
  c.model.d_model = 2048
  c.model.num_layers = 1
  c.model.num_heads = 16
  c.model.num_kv_heads = 16
  c.model.head_dim = 128
  c.model.mlp_dim = 8192
  c.model.max_seq_len = 1024
  c.optimizer.warmup_steps = 2
  return c
