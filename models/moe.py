"""Mixture-of-Experts feed-forward layer (GShard / Switch style) in Flax NNX.

A router scores every token against ``num_experts`` experts; each token goes to
its ``top_k`` best (softmax probabilities, renormalized over the chosen ones
when ``top_k > 1``). Every expert takes at most ``capacity`` tokens per sequence
(a *group*):

  capacity = ceil(capacity_factor * tokens_per_group * top_k / num_experts),

rounded up to a multiple of ``overlap_chunks`` so that chunked and unchunked
exchanges see the same slots. Slots are filled in token order, each token's choices
in the order of preference; assignments past capacity are dropped (the token's
residual passes through). So whether a token's choice fits depends only on that token
and the ones before it: a decoder's output at a position never depends on later tokens.
(GShard fills every first choice of the group before any second choice, which lets a
later token's first choice take the slot an earlier token's second choice needed: with
top_k=2 the output at a position would change with the tokens after it.) ``dropless``
sets the capacity to the group length, so nothing can drop (static shapes: ragged
all-to-all is not available on every backend).

Auxiliary losses, averaged over MoE layers and added to the training loss:

* load balance (Switch Transformer eq. 4, GShard): ``E * sum_e f_e * P_e``, with
  ``f_e`` the fraction of routing assignments (token, choice) that chose expert
  ``e`` (before capacity) and ``P_e`` the mean router probability of ``e``;
  1.0 when routing is uniform. Weight ``load_balance_weight``.
* router z-loss (ST-MoE): ``mean_tokens(logsumexp(router logits)^2)``. Weight
  ``router_z_weight``.

Tensors: the dispatched tokens are ``[batch, exp, capacity, embed]``; experts run
on ``[exp, batch, capacity, embed]``. Moving between the two is the expert
all-to-all, which ``Ops.experts`` owns (parallelism/moe.py decomposes it).
Shape letters: b batch (groups), t tokens, d embed, e experts, c capacity, f mlp.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.ops import Ops, param, weight

DISPATCHED = ('batch', 'exp', 'capacity', 'embed')   # before the exchange
AT_EXPERTS = ('exp', 'batch', 'capacity', 'embed')   # after it


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """The ``moe.*`` config group; ``num_experts=0`` means dense MLPs everywhere."""
  num_experts: int = 0
  top_k: int = 2
  every: int = 1                   # layer i is MoE when (i + 1) % every == 0
  mlp_dim: int = 1024              # each expert's SwiGLU hidden width
  capacity_factor: float = 1.25
  dropless: bool = False
  load_balance_weight: float = 0.01
  router_z_weight: float = 1e-3
  overlap_chunks: int = 2          # chunks of the decomposed all-to-all (parallelism)

  @classmethod
  def from_config(cls, cfg: Any) -> 'MoeConfig':
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(cfg).items() if k in fields})

  @property
  def enabled(self) -> bool:
    return self.num_experts > 0

  def is_moe_layer(self, i: int) -> bool:
    return self.enabled and (i + 1) % self.every == 0

  def capacity(self, group: int) -> int:
    base = group if self.dropless else math.ceil(
        self.capacity_factor * group * self.top_k / self.num_experts)
    return math.ceil(max(base, 1) / self.overlap_chunks) * self.overlap_chunks

  def validate(self, num_layers: int) -> None:
    if self.num_experts < 0:
      raise ValueError(f'moe.num_experts={self.num_experts} must be >= 0 (0: dense MLPs)')
    if not self.enabled:
      return
    checks = {'top_k': 1 <= self.top_k <= self.num_experts,
              'every': 1 <= self.every <= num_layers,
              'capacity_factor': 0 < self.capacity_factor < math.inf,
              'overlap_chunks': self.overlap_chunks >= 1, 'mlp_dim': self.mlp_dim >= 1,
              'load_balance_weight': self.load_balance_weight >= 0,  # False for NaN too
              'router_z_weight': self.router_z_weight >= 0}
    need = {'top_k': 'in [1, num_experts]', 'every': 'in [1, model.num_layers]',
            'capacity_factor': 'finite and > 0', 'overlap_chunks': '>= 1', 'mlp_dim': '>= 1',
            'load_balance_weight': '>= 0', 'router_z_weight': '>= 0'}
    for name, ok in checks.items():
      if not ok:
        raise ValueError(f'moe.{name}={getattr(self, name)} must be {need[name]}')


@dataclasses.dataclass
class Routing:
  """Where each token goes: one-hot slots and their combine weights, plus stats."""
  dispatch_btec: jax.Array   # 1 where token t of group b sits in slot c of expert e
  combine_btec: jax.Array    # the gate of that assignment, else 0
  load_e: jax.Array          # fraction of assignments per expert (before capacity)
  dropped: jax.Array         # fraction of assignments dropped for capacity
  load_balance_loss: jax.Array
  router_z_loss: jax.Array


def route(logits_bte: jax.Array, top_k: int, capacity: int) -> Routing:
  """Top-k routing with per-group capacity (see the module docstring)."""
  b, t, e = logits_bte.shape
  logits_bte = logits_bte.astype(jnp.float32)
  probs_bte = jax.nn.softmax(logits_bte, axis=-1)
  gates_btk, experts_btk = jax.lax.top_k(probs_bte, top_k)
  if top_k > 1:
    gates_btk = gates_btk / jnp.sum(gates_btk, axis=-1, keepdims=True)
  chosen_bkte = jax.nn.one_hot(experts_btk, e, dtype=jnp.float32).transpose(0, 2, 1, 3)
  # Slot of each assignment in its expert's buffer: in token order, each token's choices in
  # order of preference (causal: a slot never depends on later tokens; module docstring).
  order = chosen_bkte.transpose(0, 2, 1, 3).reshape(b, t * top_k, e)
  slot = (jnp.cumsum(order, axis=1) - 1).reshape(b, t, top_k, e).transpose(0, 2, 1, 3)
  kept_bkte = chosen_bkte * (slot < capacity)
  slot_bktec = jax.nn.one_hot(jnp.where(kept_bkte > 0, slot, -1).astype(jnp.int32), capacity,
                              dtype=jnp.float32)
  dispatch_btec = jnp.einsum('bkte,bktec->btec', kept_bkte, slot_bktec)
  combine_btec = jnp.einsum('btk,bkte,bktec->btec', gates_btk, kept_bkte, slot_bktec)
  load_e = jnp.mean(chosen_bkte, axis=(0, 1, 2))
  return Routing(
      dispatch_btec, combine_btec, load_e,
      dropped=1.0 - jnp.sum(kept_bkte) / (b * t * top_k),
      load_balance_loss=e * jnp.sum(load_e * jnp.mean(probs_bte, axis=(0, 1))),
      router_z_loss=jnp.mean(jax.nn.logsumexp(logits_bte, axis=-1) ** 2))


class MoeMlp(nnx.Module):
  """Routes tokens to SwiGLU experts and combines their outputs by gate."""

  def __init__(self, moe: MoeConfig, d_model: int, num_layers: int, dtype: str,
               param_dtype: str, ops: Ops, rngs: nnx.Rngs, path: str = 'moe',
               grads_in_param_dtype: bool = False):
    self.moe, self.dtype, self.ops, self.path = moe, dtype, ops, path
    self.grads_in_param_dtype = grads_in_param_dtype  # models.ops.weight
    d, e, f = d_model, moe.num_experts, moe.mlp_dim
    self.router_de = param(rngs, (d, e), ('embed', None), param_dtype, d)
    self.gate_edf = param(rngs, (e, d, f), ('exp', 'embed', 'mlp'), param_dtype, d)
    self.up_edf = param(rngs, (e, d, f), ('exp', 'embed', 'mlp'), param_dtype, d)
    self.down_efd = param(rngs, (e, f, d), ('exp', 'mlp', 'embed'), param_dtype, f,
                          scale=(2 * num_layers) ** -0.5)

  def __call__(self, x_btd: jax.Array, residual_axes) -> tuple[jax.Array, dict]:
    ops, dt = self.ops, jnp.dtype(self.dtype)
    x_btd = ops.constrain(x_btd, ('batch', 'length', 'embed'))
    router = weight(self.router_de[...], dt, self.grads_in_param_dtype)
    logits = checkpoint_name(jnp.einsum('btd,de->bte', x_btd, router,
                                        preferred_element_type=jnp.float32), 'moe_router')
    r = route(logits, self.moe.top_k, self.moe.capacity(x_btd.shape[1]))
    x_becd = ops.constrain(jnp.einsum('btd,btec->becd', x_btd, r.dispatch_btec.astype(dt)),
                           DISPATCHED)
    flops = 6 * x_becd.size * self.moe.mlp_dim  # three matmuls, 2 FLOPs per multiply-add
    weights = 3 * self.gate_edf[...].size * dt.itemsize  # read by every pass over tokens
    y_becd = ops.experts(x_becd, self._experts, chunks=self.moe.overlap_chunks, flops=flops,
                         weight_bytes=weights, name=f'{self.path}.exchange')
    out_btd = jnp.einsum('becd,btec->btd', y_becd, r.combine_btec.astype(dt))
    aux = {'load_balance_loss': r.load_balance_loss, 'router_z_loss': r.router_z_loss,
           'dropped_fraction': r.dropped, 'expert_load': r.load_e}
    return ops.constrain(out_btd, residual_axes), aux

  def _experts(self, x_ebcd: jax.Array) -> jax.Array:
    """Every expert's SwiGLU on its tokens: [exp, batch, capacity, embed] -> same."""
    ops, dt = self.ops, jnp.dtype(self.dtype)
    # The hidden activations split mlp, not capacity, over the axis that splits both
    # elsewhere (the experts' tensor parallelism): capacity gets no name here.
    hid = ('exp', 'batch', None, 'mlp')
    cast = lambda w: weight(w[...], dt, self.grads_in_param_dtype)
    up = lambda w, name: ops.einsum('ebcd,edf->ebcf', x_ebcd, cast(w),
                                    x_axes=AT_EXPERTS, w_axes=('exp', 'embed', 'mlp'),
                                    out_axes=hid, name=f'{self.path}.{name}')
    h = jax.nn.silu(up(self.gate_edf, 'gate')) * up(self.up_edf, 'up')
    return ops.einsum('ebcf,efd->ebcd', h, cast(self.down_efd), x_axes=hid,
                      w_axes=('exp', 'mlp', 'embed'), out_axes=AT_EXPERTS,
                      name=f'{self.path}.down')


def zero_aux(num_experts: int) -> dict:
  """The aux record of a dense layer (nothing routed)."""
  return {'load_balance_loss': jnp.zeros((), jnp.float32),
          'router_z_loss': jnp.zeros((), jnp.float32),
          'dropped_fraction': jnp.zeros((), jnp.float32),
          'expert_load': jnp.zeros((max(num_experts, 1),), jnp.float32)}
