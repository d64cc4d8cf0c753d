"""Optimizer: AdamW with a warmup + decay learning-rate schedule and global-norm clipping."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.transformer import LAYERS
from trainer.config import Optimizer

SCHEDULES = ('cosine', 'linear', 'constant', 'wsd', 'rsqrt')
MOMENT_DTYPES = ('param', 'float32', 'bfloat16')  # AdamW's moments (mu_dtype, nu_dtype)


def learning_rate_schedule(opt_cfg: Optimizer, steps: int) -> optax.Schedule:
  """Linear warmup from 0 to the peak over ``warmup_steps``, then ``optimizer.schedule``.

  Peak ``learning_rate``; ``end = end_lr_fraction * peak``.

  * ``cosine``: cosine decay to ``end`` at ``steps``.
  * ``linear``: linear decay to ``end`` at ``steps``.
  * ``constant``: the peak until the end.
  * ``wsd`` (warmup-stable-decay): the peak, then a linear decay to ``end`` over
    the last ``decay_fraction * steps`` steps (a run can branch off before it).
  * ``rsqrt``: ``peak * sqrt(w / step)`` after the warmup (``w = max(warmup_steps, 1)``);
    no end value.
  """
  warmup = min(opt_cfg.warmup_steps, max(steps - 1, 0))
  after = _after_warmup(opt_cfg, steps, warmup)
  if not warmup:
    return after
  return optax.join_schedules(
      [optax.linear_schedule(0.0, opt_cfg.learning_rate, warmup), after], [warmup])


# What the schedule depends on besides ``steps``: a resume that changes one is announced.
SCHEDULE_KEYS = ('learning_rate', 'schedule', 'warmup_steps', 'end_lr_fraction',
                 'decay_fraction')


def schedule_change(before: dict | None, steps: int, opt_cfg: Optimizer,
                    step: int) -> str | None:
  """One line saying how resuming at ``step`` changes the learning-rate schedule, or None.

  ``before``: the checkpoint's config (a dict; None for a checkpoint that lacks it).
  The schedule is a function of ``steps`` and the optimizer's SCHEDULE_KEYS, so a resume
  with another ``--config.steps`` continues on another curve.
  """
  if not before:
    return None
  old_steps = before.get('steps', steps)
  old = dataclasses.replace(opt_cfg, **{k: v for k, v in before.get('optimizer', {}).items()
                                        if k in SCHEDULE_KEYS})
  changed = ([f'steps {old_steps} -> {steps}'] if old_steps != steps else []) + [
      f'optimizer.{k} {getattr(old, k)} -> {getattr(opt_cfg, k)}' for k in SCHEDULE_KEYS
      if getattr(old, k) != getattr(opt_cfg, k)]
  if not changed:
    return None
  was = float(learning_rate_schedule(old, old_steps)(step))
  now = float(learning_rate_schedule(opt_cfg, steps)(step))
  return (f'the learning-rate schedule differs from the checkpoint\'s ({", ".join(changed)}): '
          f'the learning rate at step {step} is {now:.3g} ({was:.3g} on the old schedule)')


def _after_warmup(opt_cfg: Optimizer, steps: int, warmup: int) -> optax.Schedule:
  """The schedule from the end of the warmup on (its step 0 is the peak)."""
  kind, peak = opt_cfg.schedule, opt_cfg.learning_rate
  end, rest = peak * opt_cfg.end_lr_fraction, max(steps - warmup, 1)
  if kind == 'cosine':
    return optax.cosine_decay_schedule(peak, rest, alpha=opt_cfg.end_lr_fraction)
  if kind == 'linear':
    return optax.linear_schedule(peak, end, rest)
  if kind == 'wsd':
    decay = min(round(opt_cfg.decay_fraction * steps), rest)
    if decay:
      return optax.join_schedules([optax.constant_schedule(peak),
                                   optax.linear_schedule(peak, end, decay)], [rest - decay])
  if kind == 'rsqrt':
    w = max(warmup, 1)
    return lambda count: peak * jax.lax.rsqrt((jnp.asarray(count, jnp.float32) + w) / w)
  return optax.constant_schedule(peak)  # constant, and wsd without a decay


def decay_mask(params) -> Any:
  """True for the matrices of ``params`` (an nnx.State): weights with two or more logical
  axes besides the scanned layers' stacking axis, so that a scanned model's norm scales,
  ``('layers', 'norm')``, are not decayed where an unscanned model's ``('norm',)`` are not.
  A leaf without logical axes counts its dimensions."""
  def matrix(leaf) -> bool:
    axes = getattr(leaf, 'out_sharding', None) if isinstance(leaf, nnx.Variable) else None
    if axes is None:
      return jnp.ndim(leaf[...] if isinstance(leaf, nnx.Variable) else leaf) >= 2
    return sum(a != LAYERS for a in axes) >= 2
  return jax.tree.map(matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(opt_cfg: Optimizer,
                   steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Returns (optimizer, schedule). Weight decay applies to matrices only (``decay_mask``)."""
  schedule = learning_rate_schedule(opt_cfg, steps)
  parts = []
  if opt_cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(opt_cfg.grad_clip))
  mu_dtype = None if opt_cfg.mu_dtype == 'param' else jnp.dtype(opt_cfg.mu_dtype)
  adamw = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                      mu_dtype=mu_dtype, weight_decay=opt_cfg.weight_decay, mask=decay_mask)
  if opt_cfg.nu_dtype != 'param':
    adamw = second_moment_in(jnp.dtype(opt_cfg.nu_dtype), adamw)
  parts.append(adamw)
  return optax.chain(*parts), schedule


def moment_bytes(dtype: str) -> int:
  """Bytes a parameter of one AdamW moment in ``dtype`` (MOMENT_DTYPES; param: fp32)."""
  return 2 if dtype == 'bfloat16' else 4


def second_moment_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` (an AdamW) with its second moment kept in ``dtype`` between steps.

  optax's AdamW takes a dtype for its first moment only. Here each update reads the
  second moment into fp32, updates it with ``inner``'s arithmetic and rounds it once to
  ``dtype`` (DeepSeek-V3 keeps both moments in bf16).
  """
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)

  def cast(state, to):
    as_to = lambda s: s._replace(nu=jax.tree.map(lambda x: x.astype(to), s.nu))
    return jax.tree.map(lambda s: as_to(s) if is_adam(s) else s, state, is_leaf=is_adam)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)

  return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)
