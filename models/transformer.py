"""Decoder-only Transformer language model in Flax NNX.

Token embedding, RMSNorm, rotary position embedding, grouped-query attention,
SwiGLU MLP, optional tied embeddings, causal masking that also stops attention
across packed document boundaries, optional scan over layers and remat, and a decode path with a key/value cache
(``init_cache``, ``decode``) for generation.

Every weight names its logical axes (``embed``, ``mlp``, ``heads``,
``kv_heads``, ``head_dim``, ``vocab``, ``layers``); activations are declared
through :class:`models.ops.Ops`. The residual stream between blocks is
``('batch', 'residual_length', 'embed')``, a sequence axis of its own, so that
rules can shard it over a mesh axis (sequence parallelism) while activations
inside a block (``'length'``) stay whole. Nothing here knows about meshes.
Shape letters: b batch, t/s query/key position, d embed, f mlp, n heads,
k kv_heads, g query heads per kv head, h head_dim, v vocab, l layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.attention import attend_blockwise, attend_cudnn, attend_splash
from models.moe import MoeConfig, MoeMlp, zero_aux
from models.ops import Ops, param, weight

# The projections' outputs, named where each is made: q/k/v (or the fused qkv), the
# attention output, the MLP's gate/up and down, the MoE router's logits.
_QKV = ('qkv_proj', 'query_proj', 'key_proj', 'value_proj')
_MLP = ('mlp_gate_up', 'mlp_gate', 'mlp_up', 'mlp_down', 'moe_router')

# 'minimal' is MaxText's name for 'dots': keep the projections' outputs, recompute the
# rest (norms, attention, activations). They are kept by name rather than as "dots
# without batch dimensions" (jax's checkpoint_dots_with_no_batch_dims, which keeps the
# same tensors in a plain program): in a decomposed ring that policy keeps each ring
# step's dot instead, a stack of blocks (for a reduce-scatter ring, one output-sized
# partial sum per step) that the backward pass re-slices; by name, the ring's whole
# output is kept once (the joined gate/up one as its gate and up parts: ``ops.saved``).
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.save_only_these_names(*_QKV, 'out_proj', *_MLP),
    # MaxText's name: keep the attention projections' outputs, recompute the MLP. The
    # backward pass then repeats no attention projection (nor its collectives) for a
    # fraction of 'minimal''s memory.
    'save_dot_except_mlp': jax.checkpoint_policies.save_only_these_names(*_QKV, 'out_proj'),
    # Keep the attention output projection's and the MLP's outputs, recompute q/k/v:
    # nearly 'minimal''s step for less memory (q/k/v are the widest attention outputs).
    'save_dot_except_qkv': jax.checkpoint_policies.save_only_these_names('out_proj', *_MLP),
}
REMAT_POLICIES['minimal'] = REMAT_POLICIES['dots']


# 'xla': softmax over the whole [t, s] logits, as XLA compiles it; 'blockwise': keys in
# blocks with an online softmax and a recomputing backward; 'cudnn': cuDNN's flash
# attention (NVIDIA GPUs); 'splash': the Pallas splash attention kernel (TPUs); 'auto':
# the trainer picks one per platform before the model is built (models/attention.py:
# choose).
ATTENTION = ('xla', 'blockwise', 'splash', 'cudnn', 'auto')


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Model hyperparameters (the ``model.*`` config group)."""
  vocab_size: int = 264
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 8
  num_kv_heads: int = 8
  head_dim: int = 32
  mlp_dim: int = 1024
  max_seq_len: int = 1024
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = False
  dtype: str = 'float32'  # compute dtype
  param_dtype: str = 'float32'
  scan_layers: bool = False
  # Layers per iteration of the layer scan: with 2, the compiler schedules the second
  # layer's weight gathers during the first layer's compute (a gather at the top of a
  # scan iteration has nothing before it to hide behind).
  scan_unroll: int = 1
  # Cast each scanned layer's weights inside the scan, behind an optimization barrier:
  # otherwise the compiler converts every layer's stacked weights to `dtype` once before
  # the layer loops and keeps that copy alive through the forward and backward passes
  # (TPU; 1.84 GiB per chip at moe_1t). The barrier also keeps the compiler from
  # pipelining a layer's weight gathers into the iteration before.
  cast_in_loop: bool = False
  # Convert each layer weight's gradient to `param_dtype` inside the layer, as a plain cast
  # does (and MaxText's programs, which the calibration rows compile): a scanned model then
  # stacks fp32 gradients. By default they stay in `dtype` until the optimizer
  # (models.ops.weight; the same values, half the bytes).
  grads_in_param_dtype: bool = False
  remat: str = 'none'  # one of REMAT_POLICIES
  attention: str = 'xla'      # one of ATTENTION
  attention_block: int = 512  # key positions per block of 'blockwise' and 'splash'
  splash_interpret: bool = False  # 'splash' through the Pallas interpreter (CPU tests)
  fused_projections: bool = False  # one einsum for q/k/v and one for gate/up
  moe: MoeConfig = MoeConfig()  # the ``moe.*`` group; dense when num_experts == 0

  # How the step is computed, not which parameters or what result: a run may resume with
  # these changed (another platform's attention kernel, more remat on a smaller mesh).
  EXECUTION_ONLY = ('scan_unroll', 'cast_in_loop', 'grads_in_param_dtype', 'remat',
                    'attention', 'attention_block', 'splash_interpret', 'fused_projections')

  @classmethod
  def from_config(cls, cfg: Any, moe_cfg: Any = None) -> 'TransformerConfig':
    """From the ``model.*`` group (and ``moe.*``), or a checkpoint's model dict."""
    fields = {f.name for f in dataclasses.fields(cls)} - {'moe'}
    moe_cfg = moe_cfg if moe_cfg is not None else dict(cfg).get('moe')
    moe = MoeConfig.from_config(moe_cfg) if moe_cfg is not None else MoeConfig()
    return cls(**{k: v for k, v in dict(cfg).items() if k in fields}, moe=moe)

  @property
  def layers_per_unit(self) -> int:
    """Blocks per repeated unit: ``moe.every`` with MoE (the last one MoE), else 1."""
    return self.moe.every if self.moe.enabled else 1

  def validate(self) -> None:
    self.moe.validate(self.num_layers)
    if self.scan_layers and self.num_layers % self.layers_per_unit:
      raise ValueError(f'model.scan_layers needs model.num_layers={self.num_layers} to be a '
                       f'multiple of moe.every={self.moe.every}')
    units = self.num_layers // self.layers_per_unit
    if self.scan_unroll < 1 or (self.scan_layers and units % self.scan_unroll):
      raise ValueError(f'model.scan_unroll={self.scan_unroll} does not divide the '
                       f'{units} scanned units (model.num_layers / the layers per unit)')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'model.num_heads={self.num_heads} is not a multiple of '
                       f'model.num_kv_heads={self.num_kv_heads}')
    if self.attention not in ATTENTION:
      raise ValueError(f'model.attention={self.attention!r} is not one of {sorted(ATTENTION)}')
    if self.attention_block < 1:
      raise ValueError(f'model.attention_block={self.attention_block} is not positive')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'model.remat={self.remat!r} is not one of '
                       f'{sorted(REMAT_POLICIES)}')
    for name in ('dtype', 'param_dtype'):
      if getattr(self, name) not in ('float32', 'bfloat16', 'float16'):
        raise ValueError(f'model.{name}={getattr(self, name)!r} is not one of '
                         'float32, bfloat16, float16')


class RMSNorm(nnx.Module):

  def __init__(self, cfg: TransformerConfig):
    self.eps = cfg.norm_eps
    self.scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.param_dtype),
                           out_sharding=('norm',), eager_sharding=False)

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    x = x_btd.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(x_btd.dtype)


def rotary(x_btnh: jax.Array, positions_bt: jax.Array, theta: float):
  """Rotates channel pairs (i, i + h/2) by position-dependent angles."""
  half = x_btnh.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_bth = positions_bt[..., None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle_bth)[:, :, None], jnp.cos(angle_bth)[:, :, None]
  x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_btnh.dtype)


RESIDUAL = ('batch', 'residual_length', 'embed')
CACHE = ('batch', 'cache_length', 'kv_heads', 'head_dim')  # one layer's keys or values
LAYERS = 'layers'  # the logical axis scanned layers' weights are stacked along
# The splash kernel's blocks: batch rows and heads, whole sequences. The kernel pairs each
# device's query heads with its own key/value heads by position, so the two must be split
# alike (trainer/validation.py checks the rules).
SPLASH_Q, SPLASH_KV = ('batch', None, 'heads', None), ('batch', None, 'kv_heads', None)


class Attention(nnx.Module):
  """Multi-head attention with grouped-query option (num_kv_heads)."""

  def __init__(self, cfg: TransformerConfig, ops: Ops, rngs: nnx.Rngs, path: str = 'attn'):
    self.cfg, self.ops, self.path = cfg, ops, path
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_dnh = param(rngs, (d, n, h), ('embed', 'heads', 'head_dim'), cfg.param_dtype, d)
    self.k_dkh = param(rngs, (d, k, h), ('embed', 'kv_heads', 'head_dim'), cfg.param_dtype, d)
    self.v_dkh = param(rngs, (d, k, h), ('embed', 'kv_heads', 'head_dim'), cfg.param_dtype, d)
    self.o_nhd = param(rngs, (n, h, d), ('heads', 'head_dim', 'embed'), cfg.param_dtype,
                       n * h, scale=(2 * cfg.num_layers) ** -0.5)

  def __call__(self, x_btd, positions_bt, segments_bt):
    q_btnh, k_btkh, v_btkh = self._qkv(x_btd, positions_bt)
    if self.cfg.attention == 'blockwise':
      block = min(self.cfg.attention_block, q_btnh.shape[1])
      return self._out(attend_blockwise(q_btnh, k_btkh, v_btkh, segments_bt, block))
    if self.cfg.attention == 'splash':
      return self._out(self._splash(q_btnh, k_btkh, v_btkh, segments_bt))
    if self.cfg.attention == 'cudnn':
      return self._out(attend_cudnn(q_btnh, k_btkh, v_btkh, segments_bt))
    if self.cfg.attention == 'auto':  # no silent choice here: the platform is not known
      raise ValueError("model.attention='auto' is chosen per platform before the model is "
                       'built (models/attention.py: choose)')
    return self._out(attend(q_btnh, k_btkh, v_btkh, segments_bt))

  def decode(self, x_btd, positions_bt, cache, index):
    """Attention of ``t`` new tokens to the cache, after writing theirs at ``index``.

    ``cache`` holds this layer's ``k`` and ``v``, ``[b, s, kv_heads, head_dim]``
    (axes ``CACHE``); row r's new tokens sit at ``index .. index + t - 1`` and
    each attends to the cache slots up to its position. Returns the output and
    the updated cache.
    """
    q_btnh, k_btkh, v_btkh = self._qkv(x_btd, positions_bt)
    write = lambda c, new: self.ops.constrain(jax.lax.dynamic_update_slice_in_dim(
        c, new.astype(c.dtype), index, axis=1), CACHE)
    k_bskh, v_bskh = write(cache['k'], k_btkh), write(cache['v'], v_btkh)
    mask_bts = jnp.arange(k_bskh.shape[1])[None, None, :] <= positions_bt[:, :, None]
    out_btnh = attend_masked(q_btnh, k_bskh, v_bskh, mask_bts)
    return self._out(out_btnh), {'k': k_bskh, 'v': v_bskh}

  def _qkv(self, x_btd, positions_bt):
    """Query, key and value projections, rotated by position."""
    cfg, ops, dt = self.cfg, self.ops, jnp.dtype(self.cfg.dtype)
    proj = lambda eq, w, w_axes, out_axes, name: ops.einsum(
        eq, x_btd, w, x_axes=RESIDUAL, w_axes=w_axes,
        out_axes=out_axes, name=f'{self.path}.{name}')
    q, k, v = (weight(w[...], dt, cfg.grads_in_param_dtype)
               for w in (self.q_dnh, self.k_dkh, self.v_dkh))
    if cfg.fused_projections:  # one einsum; each kv head's group of queries, then k, v
      b, t, n, h, kv = *x_btd.shape[:2], cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
      g = n // kv
      w_dkgh = jnp.concatenate([q.reshape(-1, kv, g, h), k[:, :, None], v[:, :, None]], 2)
      out = proj('btd,dkgh->btkgh', w_dkgh, ('embed', 'kv_heads', None, 'head_dim'),
                 ('batch', 'length', 'kv_heads', None, 'head_dim'), 'qkv')
      out = checkpoint_name(out, 'qkv_proj')
      q_btnh, k_btkh, v_btkh = out[:, :, :, :g].reshape(b, t, n, h), out[:, :, :, g], \
          out[:, :, :, g + 1]
    else:
      q_btnh = proj('btd,dnh->btnh', q, ('embed', 'heads', 'head_dim'),
                    ('batch', 'length', 'heads', 'head_dim'), 'q')
      k_btkh = proj('btd,dkh->btkh', k, ('embed', 'kv_heads', 'head_dim'),
                    ('batch', 'length', 'kv_heads', 'head_dim'), 'k')
      v_btkh = proj('btd,dkh->btkh', v, ('embed', 'kv_heads', 'head_dim'),
                    ('batch', 'length', 'kv_heads', 'head_dim'), 'v')
      q_btnh, k_btkh, v_btkh = (checkpoint_name(a, f'{w}_proj') for a, w in
                                ((q_btnh, 'query'), (k_btkh, 'key'), (v_btkh, 'value')))
    q_btnh = rotary(q_btnh, positions_bt, cfg.rope_theta)
    k_btkh = rotary(k_btkh, positions_bt, cfg.rope_theta)
    return q_btnh, k_btkh, v_btkh

  def _splash(self, q_btnh, k_btkh, v_btkh, segments_bt):
    """The splash kernel on each device's batch rows and heads, whole sequences."""
    q_axes, kv_axes = SPLASH_Q, SPLASH_KV
    kernel = functools.partial(attend_splash, block=self.cfg.attention_block,
                               interpret=self.cfg.splash_interpret)
    return self.ops.local(kernel, q_btnh, k_btkh, v_btkh, segments_bt,
                          in_axes=(q_axes, kv_axes, kv_axes, ('batch', None)), out_axes=q_axes)

  def _out(self, out_btnh):
    """The output projection back to the residual stream."""
    ops, dt = self.ops, jnp.dtype(self.cfg.dtype)
    out_btnh = ops.constrain(out_btnh, ('batch', 'length', 'heads', 'head_dim'))
    return checkpoint_name(ops.einsum(
        'btnh,nhd->btd', out_btnh,
        weight(self.o_nhd[...], dt, self.cfg.grads_in_param_dtype),
        x_axes=('batch', 'length', 'heads', 'head_dim'),
        w_axes=('heads', 'head_dim', 'embed'), out_axes=RESIDUAL, name=f'{self.path}.o'),
        'out_proj')


def attend(q_btnh, k_bskh, v_bskh, segments_bt):
  """Causal softmax attention that never crosses a packed-document boundary."""
  t = q_btnh.shape[1]
  causal_ts = jnp.tril(jnp.ones((t, t), bool))
  same_doc_bts = segments_bt[:, :, None] == segments_bt[:, None, :]
  return attend_masked(q_btnh, k_bskh, v_bskh, causal_ts[None] & same_doc_bts)


def attend_masked(q_btnh, k_bskh, v_bskh, mask_bts):
  """Softmax attention of queries t to keys s where ``mask_bts`` is True."""
  b, t, n, h = q_btnh.shape
  k = k_bskh.shape[2]
  q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
  logits = jnp.einsum('btkgh,bskh->bkgts', q_btkgh, k_bskh,
                      preferred_element_type=jnp.float32) * h ** -0.5
  mask = mask_bts[:, None, None]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_bskh.dtype)
  out = jnp.einsum('bkgts,bskh->btkgh', probs, v_bskh,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, n, h).astype(q_btnh.dtype)


class Mlp(nnx.Module):
  """SwiGLU feed-forward: (silu(x W_gate) * x W_up) W_down."""

  def __init__(self, cfg: TransformerConfig, ops: Ops, rngs: nnx.Rngs, path: str = 'mlp'):
    self.cfg, self.ops, self.path = cfg, ops, path
    d, f = cfg.d_model, cfg.mlp_dim
    self.gate_df = param(rngs, (d, f), ('embed', 'mlp'), cfg.param_dtype, d)
    self.up_df = param(rngs, (d, f), ('embed', 'mlp'), cfg.param_dtype, d)
    self.down_fd = param(rngs, (f, d), ('mlp', 'embed'), cfg.param_dtype, f,
                         scale=(2 * cfg.num_layers) ** -0.5)

  def __call__(self, x_btd):
    ops, dt = self.ops, jnp.dtype(self.cfg.dtype)
    hid = ('batch', 'length', 'mlp')
    gate, up = (weight(w[...], dt, self.cfg.grads_in_param_dtype)
                for w in (self.gate_df, self.up_df))
    names = ('gate_up',) if self.cfg.fused_projections else ('gate', 'up')
    # the SwiGLU between them is position-wise: its tokens may stay in ring order
    chain = (tuple(f'{self.path}.{n}' for n in names), f'{self.path}.down')
    if self.cfg.fused_projections:  # one einsum over both weights
      both = ops.einsum('btd,sdf->btsf', x_btd, jnp.stack([gate, up]), x_axes=RESIDUAL,
                        w_axes=(None, 'embed', 'mlp'), out_axes=('batch', 'length', None, 'mlp'),
                        name=f'{self.path}.gate_up', save_as='mlp_gate_up',
                        save_parts=(2, ('mlp_gate', 'mlp_up')), position_wise=chain)
      gated, upped = both[:, :, 0], both[:, :, 1]
    else:
      proj = lambda w, name: ops.einsum('btd,df->btf', x_btd, w, x_axes=RESIDUAL,
                                        w_axes=('embed', 'mlp'), out_axes=hid,
                                        name=f'{self.path}.{name}', position_wise=chain)
      gated, upped = (checkpoint_name(proj(w, n), f'mlp_{n}') for w, n in
                      ((gate, 'gate'), (up, 'up')))
    h_btf = jax.nn.silu(gated) * upped
    down = weight(self.down_fd[...], dt, self.cfg.grads_in_param_dtype)
    return checkpoint_name(ops.einsum(
        'btf,fd->btd', h_btf, down, x_axes=hid, w_axes=('mlp', 'embed'), out_axes=RESIDUAL,
        name=f'{self.path}.down', position_wise=chain), 'mlp_down')


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)) (MLP or MoE)."""

  def __init__(self, cfg: TransformerConfig, ops: Ops, rngs: nnx.Rngs, path: str = 'block',
               moe_layer: bool = False):
    self.ops, self.num_experts = ops, cfg.moe.num_experts
    self.attn_norm = RMSNorm(cfg)
    self.attn = Attention(cfg, ops, rngs, f'{path}.attn')
    self.mlp_norm = RMSNorm(cfg)
    if moe_layer:
      self.moe = MoeMlp(cfg.moe, cfg.d_model, cfg.num_layers, cfg.dtype, cfg.param_dtype,
                        ops, rngs, f'{path}.moe', cfg.grads_in_param_dtype)
    else:
      self.mlp = Mlp(cfg, ops, rngs, f'{path}.mlp')

  def __call__(self, x_btd, positions_bt, segments_bt):
    """Returns the new residual stream and the MoE aux record (zeros when dense)."""
    x_btd = x_btd + self.attn(self.attn_norm(x_btd), positions_bt, segments_bt)
    if hasattr(self, 'moe'):
      y_btd, aux = self.moe(self.mlp_norm(x_btd), RESIDUAL)
    else:
      y_btd, aux = self.mlp(self.mlp_norm(x_btd)), zero_aux(self.num_experts)
    return self.ops.constrain(x_btd + y_btd, RESIDUAL), aux

  def decode(self, x_btd, positions_bt, cache, index):
    """Like ``__call__`` for new tokens with a key/value cache (dense blocks only)."""
    y_btd, cache = self.attn.decode(self.attn_norm(x_btd), positions_bt, cache, index)
    x_btd = x_btd + y_btd
    return self.ops.constrain(x_btd + self.mlp(self.mlp_norm(x_btd)), RESIDUAL), cache


class BlockGroup(nnx.Module):
  """``moe.every`` blocks, the last one MoE: the unit a scan repeats."""

  def __init__(self, cfg: TransformerConfig, ops: Ops, rngs: nnx.Rngs, path: str):
    n = cfg.layers_per_unit
    self.layers = nnx.List([Block(cfg, ops, rngs, f'{path}.{j}', moe_layer=j == n - 1)
                            for j in range(n)])

  def __call__(self, x_btd, positions_bt, segments_bt):
    total = None
    for block in self.layers:
      x_btd, aux = block(x_btd, positions_bt, segments_bt)
      total = aux if total is None else jax.tree.map(jnp.add, total, aux)
    return x_btd, total


class Transformer(nnx.Module):
  """The language model: tokens [b, t] -> logits [b, t, vocab] in fp32 (``_logits``)."""

  def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, ops: Ops | None = None):
    cfg.validate()
    self.cfg = cfg
    self.ops = ops = ops or Ops()
    # Untied, an embedding row is the block's input (std 1, the pre-norms rescale it); tied,
    # it is also the output layer, whose logits x . e (x of RMS 1 after the final norm)
    # would start with std sqrt(d_model): drawn as the untied output layer is, 1/sqrt(d).
    self.embed_vd = param(rngs, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'),
                          cfg.param_dtype, cfg.d_model if cfg.tie_embeddings else 1)
    if cfg.scan_layers:
      unit = lambda rngs: (Block(cfg, ops, rngs, 'blocks.*', moe_layer=cfg.moe.enabled)
                           if cfg.layers_per_unit == 1 else BlockGroup(cfg, ops, rngs, 'blocks.*'))

      @nnx.split_rngs(splits=cfg.num_layers // cfg.layers_per_unit)
      @nnx.vmap(in_axes=0, out_axes=0,
                transform_metadata={nnx.PARTITION_NAME: LAYERS})
      def make_blocks(rngs):
        return unit(rngs)
      self.blocks = make_blocks(rngs)
    else:
      self.blocks = nnx.List([Block(cfg, ops, rngs, f'blocks.{i}', cfg.moe.is_moe_layer(i))
                              for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg)
    if not cfg.tie_embeddings:
      self.unembed_dv = param(rngs, (cfg.d_model, cfg.vocab_size),
                              ('embed', 'vocab'), cfg.param_dtype, cfg.d_model)

  def __call__(self, tokens_bt, positions_bt=None, segments_bt=None, return_aux=False):
    """Logits; with ``return_aux`` also the MoE aux record, averaged over MoE layers."""
    cfg, ops, dt = self.cfg, self.ops, jnp.dtype(self.cfg.dtype)
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    if segments_bt is None:
      segments_bt = jnp.zeros_like(tokens_bt)
    x_btd = jnp.take(self.embed_vd[...], tokens_bt, axis=0).astype(dt)
    x_btd = ops.constrain(x_btd, RESIDUAL)
    x_btd, aux = self._run_blocks(x_btd, positions_bt, segments_bt)
    logits = self._logits(x_btd)
    if not return_aux:
      return logits
    moe_layers = max(sum(map(cfg.moe.is_moe_layer, range(cfg.num_layers))), 1)
    return logits, jax.tree.map(lambda a: a / moe_layers, aux)

  def _logits(self, x_btd):
    """Final norm and output layer: logits in fp32 for the loss. The output layer's einsum
    accumulates in fp32 and rounds to the compute dtype, as every dense layer's does (and
    MaxText's by default): under bf16 a logit near 20 is within 0.0625 of its fp32 value."""
    cfg, ops, dt = self.cfg, self.ops, jnp.dtype(self.cfg.dtype)
    x_btd = self.final_norm(x_btd)
    if cfg.tie_embeddings:
      w_dv, eq, w_axes = self.embed_vd[...], 'btd,vd->btv', ('vocab', 'embed')
    else:
      w_dv, eq, w_axes = self.unembed_dv[...], 'btd,dv->btv', ('embed', 'vocab')
    logits = ops.einsum(eq, x_btd, w_dv.astype(dt),
                        x_axes=RESIDUAL, w_axes=w_axes,
                        out_axes=('batch', 'length', 'vocab'), name='unembed')
    return logits.astype(jnp.float32)

  # --- Generation: a key/value cache of every layer, written at positions.

  def init_cache(self, batch: int, length: int) -> dict:
    """Empty keys and values ``[layers, batch, length, kv_heads, head_dim]``."""
    cfg = self.cfg
    if cfg.moe.enabled:
      raise ValueError(f'decoding with a cache supports dense models; this one has '
                       f'moe.num_experts={cfg.moe.num_experts} (MoE layers route whole '
                       'sequences with a capacity, which a token at a time does not reproduce)')
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    zeros = self.ops.constrain(jnp.zeros(shape, cfg.dtype), (LAYERS,) + CACHE)
    return {'k': zeros, 'v': zeros}

  def decode(self, tokens_bt, index, cache):
    """Logits of ``tokens_bt`` placed at positions ``index ..`` of one document per row.

    Writes their keys and values into ``cache`` (from ``init_cache``) and
    attends to everything written at earlier positions; ``index`` may be
    traced. Prefill is a call with the whole prompt at index 0, then one token
    at a time. Returns (logits ``[b, t, vocab]`` in fp32, as ``_logits``, the updated
    cache).
    """
    dt = jnp.dtype(self.cfg.dtype)
    positions_bt = jnp.broadcast_to(index + jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    x_btd = jnp.take(self.embed_vd[...], tokens_bt, axis=0).astype(dt)
    x_btd = self.ops.constrain(x_btd, RESIDUAL)
    if self.cfg.scan_layers:
      graphdef, state = nnx.split(self.blocks)

      def body(x, layer):
        s, c = layer
        return nnx.merge(graphdef, s).decode(x, positions_bt, c, index)
      x_btd, cache = jax.lax.scan(body, x_btd, (state, cache))
    else:
      for i, block in enumerate(self.blocks):
        x_btd, c = block.decode(x_btd, positions_bt, jax.tree.map(lambda a: a[i], cache), index)
        cache = jax.tree.map(lambda a, new: a.at[i].set(new), cache, c)
    return self._logits(x_btd), cache

  def _run_blocks(self, x_btd, positions_bt, segments_bt):
    """Applies the blocks, as a Python loop or a scan, with optional remat.

    Returns the residual stream and the MoE aux records summed over layers.
    """
    policy = REMAT_POLICIES[self.cfg.remat]

    def apply(graphdef, state, x):
      return nnx.merge(graphdef, state)(x, positions_bt, segments_bt)

    if self.cfg.remat != 'none':
      apply = jax.checkpoint(apply, policy=policy, static_argnums=(0,))
    total = zero_aux(self.cfg.moe.num_experts)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    if self.cfg.scan_layers:
      graphdef, state = nnx.split(self.blocks)

      def body(carry, s):
        if self.cfg.cast_in_loop:
          s = jax.lax.optimization_barrier(s)
        x, aux = apply(graphdef, s, carry[0])
        return (x, add(carry[1], aux)), None
      (x_btd, total), _ = jax.lax.scan(body, (x_btd, total), state,
                                       unroll=self.cfg.scan_unroll)
      return x_btd, total
    for block in self.blocks:
      graphdef, state = nnx.split(block)
      x_btd, aux = apply(graphdef, state, x_btd)
      total = add(total, aux)
    return x_btd, total


def count_params(state) -> int:
  """Number of parameters in a (possibly abstract) state tree."""
  return sum(int(x.size) for x in jax.tree.leaves(state))
