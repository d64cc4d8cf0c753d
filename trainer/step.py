"""The train and eval steps: pure functions of (state, batch)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class TrainState(NamedTuple):
  step: jax.Array
  params: Any      # nnx.State of the model's parameters
  opt_state: Any   # optax state


def cross_entropy(logits_btv, targets_bt, z_loss: float):
  """Mean token cross-entropy (nats) plus ``z_loss * log(Z)^2``; returns (total, ce)."""
  log_z_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], -1)[..., 0]
  nll_bt = log_z_bt - target_logit_bt
  ce = jnp.mean(nll_bt)
  return ce + z_loss * jnp.mean(log_z_bt ** 2), (ce, nll_bt)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    z_loss: float, accum_steps: int, skip_nonfinite: bool = False):
  """Builds ``train_step(state, batch) -> (state, metrics)``.

  With ``accum_steps > 1`` the batch is split into that many microbatches whose
  gradients are averaged before one optimizer update. ``finite`` reports whether
  the loss, the gradient norm and the updated parameters and optimizer state are
  all finite: the loss describes the weights before the update, a checkpoint
  holds those after it. With ``skip_nonfinite`` a step that is not finite leaves
  parameters and optimizer state unchanged (the step counter still advances)
  and reports ``skipped = 1``.
  """

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits, aux = model(batch['inputs'], batch['positions'], batch['segments'],
                        return_aux=True)
    total, (ce, _) = cross_entropy(logits, batch['targets'], z_loss)
    moe = model.cfg.moe
    if moe.enabled:
      total += (moe.load_balance_weight * aux['load_balance_loss']
                + moe.router_z_weight * aux['router_z_loss'])
    return total, (ce, aux if moe.enabled else {})

  value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

  def grad_fn(params, batch):
    # Layer weights' gradients arrive in the compute dtype (``models.ops.weight``); the
    # optimizer and the accumulation over microbatches work in the parameters' dtype.
    out, grads = value_and_grad(params, batch)
    return out, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


  def accumulate(params, batch):
    micro = jax.tree.map(
        lambda x: x.reshape((accum_steps, -1) + x.shape[1:]), batch)

    def body(carry, mb):
      (_, stats), grads = grad_fn(params, mb)
      return jax.tree.map(jnp.add, carry, (stats, grads)), None

    stats_shape = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], micro)))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                         (stats_shape[0][1], stats_shape[1]))
    (stats, grads), _ = jax.lax.scan(body, zeros, micro)
    return jax.tree.map(lambda x: x / accum_steps, (stats, grads))

  def train_step(state: TrainState, batch):
    if accum_steps == 1:
      (_, (ce, moe_stats)), grads = grad_fn(state.params, batch)
    else:
      (ce, moe_stats), grads = accumulate(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(ce) & jnp.isfinite(grad_norm) & all_finite((params, opt_state))
    metrics = {'loss': ce, 'grad_norm': grad_norm, 'finite': ok,
               **{f'moe_{k}': v for k, v in moe_stats.items()}}
    if skip_nonfinite:
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
      # The LR schedule's clock advances all the same: it stays ``state.step``, the step the
      # metrics log the learning rate of, and the schedule ends at ``steps``.
      clock = lambda x: isinstance(x, optax.ScaleByScheduleState)
      params = keep(params, state.params)
      opt_state = jax.tree.map(lambda n, o: n if clock(n) else keep(n, o), opt_state,
                               state.opt_state, is_leaf=clock)
      metrics['skipped'] = 1 - ok.astype(jnp.int32)
    return TrainState(state.step + 1, params, opt_state), metrics

  return train_step


def all_finite(tree) -> jax.Array:
  """Whether every floating-point element of ``tree`` is finite (one boolean)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def make_eval_step(graphdef: nnx.GraphDef, byte_vocab: int | None):
  """Builds ``eval_step(params, batch) -> sums`` of nats and counts.

  Bits per byte counts only targets that are bytes (ids below ``byte_vocab``);
  end-of-document tokens are in the loss but carry no bytes. Batches of text
  through another tokenizer carry ``target_bytes`` (UTF-8 bytes per target,
  -1 at end of document; trainer/data.py), which then gives the byte count.
  """

  def eval_step(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch['inputs'], batch['positions'], batch['segments'])
    _, (_, nll_bt) = cross_entropy(logits, batch['targets'], 0.0)
    out = {'nats': jnp.sum(nll_bt), 'tokens': jnp.float32(nll_bt.size)}
    if 'target_bytes' in batch:
      text_bt = batch['target_bytes'] >= 0
      out['byte_nats'] = jnp.sum(jnp.where(text_bt, nll_bt, 0.0))
      out['bytes'] = jnp.sum(jnp.where(text_bt, batch['target_bytes'], 0).astype(jnp.float32))
    elif byte_vocab is not None:
      is_byte = batch['targets'] < byte_vocab
      out['byte_nats'] = jnp.sum(jnp.where(is_byte, nll_bt, 0.0))
      out['bytes'] = jnp.sum(is_byte.astype(jnp.float32))
    return out

  return eval_step
