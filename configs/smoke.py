r"""Smoke run: the default run shrunk until train, eval and checkpoint take seconds.

  python -m trainer.train --config configs/smoke.py --workdir runs/smoke

A check that an install works end to end, in well under a minute on a 2-core
machine: a 2-layer byte-level LM (165,184 parameters) trains 20 steps on the
embedded corpus, on the same 8 simulated CPU devices and mesh data=4 x tensor=2
as configs/default.py, with every dense layer decomposed into a collective
einsum; it evaluates twice (with gzip's and xz's bits per byte on the same
held-out bytes) and saves checkpoints at steps 10 and 20 (the same command
again finds step 20 and has nothing to do). It learns little: on its 1,024
held-out bytes its last eval stays well above gzip -9's bits per byte.
tests/test_smoke.py runs it. Everything not set here is configs/default.py's;
override any field with --config.a.b=value.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.steps = 20                # run length, and the length of the LR schedule
  c.batch_size = 8            # global batch, in sequences (divisible by mesh.data=4)
  c.seq_len = 64              # tokens per sequence (divisible by mesh.tensor=2)
  c.log_every = 5             # steps between metric records
  c.eval_every = 10           # an eval at step 10, and one at the end
  c.eval_steps = 2            # held-out batches per eval: 2 x 8 x 64 bytes

  c.model.d_model = 64            # embed (divisible by mesh.tensor)
  c.model.num_layers = 2          # Transformer blocks
  c.model.num_heads = 4           # query heads (two per tensor shard)
  c.model.num_kv_heads = 4        # key/value heads
  c.model.head_dim = 16           # per head
  c.model.mlp_dim = 256           # SwiGLU hidden width
  c.model.max_seq_len = 64        # longest sequence the model accepts (= seq_len)

  c.optimizer.learning_rate = 1e-2    # peak learning rate: a tiny model, few steps
  c.optimizer.warmup_steps = 5        # linear warmup from 0

  c.checkpoint.every = 10         # saves at steps 10 and 20 (the end)
  return c
