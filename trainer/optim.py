"""Optimizer: AdamW with linear warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

from typing import Any

import jax
import optax


def learning_rate_schedule(opt_cfg: Any, steps: int) -> optax.Schedule:
  """Linear warmup to the peak, cosine decay to ``end_lr_fraction`` at ``steps``."""
  warmup = min(opt_cfg.warmup_steps, max(steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt_cfg.learning_rate, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1),
      end_value=opt_cfg.learning_rate * opt_cfg.end_lr_fraction)


def make_optimizer(opt_cfg: Any, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Returns (optimizer, schedule). Weight decay applies to matrices only."""
  schedule = learning_rate_schedule(opt_cfg, steps)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  parts = []
  if opt_cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(opt_cfg.grad_clip))
  parts.append(optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*parts), schedule
