"""Attention implementations beside the plain one, and which one ``'auto'`` picks.

``model.attention`` (models/transformer.py): 'xla' (the whole ``[t, s]``
logits), 'blockwise' (below), 'splash' (``attend_splash``: the Pallas splash
attention kernel on a TPU), 'cudnn' (``attend_cudnn``: cuDNN's flash attention
on an NVIDIA GPU) or 'auto' (``choose``).

Blockwise attention: causal, document-masked softmax attention in key blocks.

``attend_blockwise`` gives the same result as the plain attention of
models/transformer.py (``attend``) without ever holding the ``[t, s]`` logits
of the whole sequence: keys and values are visited one block of ``block``
positions at a time with an online softmax (running maximum and sum, as in
FlashAttention), so the temporaries are ``[t, block]`` per head. The gradient
is a custom VJP that recomputes each block's probabilities from the saved
log-sum-exp instead of storing them (FlashAttention's backward pass), so the
backward pass is blockwise too. Plain JAX: runs on every backend.

Shape letters as in models/transformer.py: b batch, t queries, s keys,
k kv_heads, g query heads per kv head, h head_dim, j key block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

_MASKED = -1e30  # logits of masked pairs; their probabilities are set to 0 explicitly


def _blocks(x, block: int):
  """``[b, s, ...]`` -> ``[s // block, b, block, ...]`` (the scan axis first)."""
  b, s = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, s // block, block, *x.shape[2:]), 1, 0)


def _scores(q_btkgh, k_bjkh, seg_bt, seg_bj, start, scale):
  """One key block's fp32 logits ``[b, k, g, t, j]`` and mask ``[b, 1, 1, t, j]``."""
  s = jnp.einsum('btkgh,bjkh->bkgtj', q_btkgh, k_bjkh,
                 preferred_element_type=jnp.float32) * scale
  t, j = q_btkgh.shape[1], k_bjkh.shape[1]
  causal_tj = jnp.arange(t)[:, None] >= start + jnp.arange(j)[None, :]
  mask = (causal_tj[None] & (seg_bt[:, :, None] == seg_bj[:, None, :]))[:, None, None]
  return jnp.where(mask, s, _MASKED), mask


def _forward(q_btkgh, k_bskh, v_bskh, seg_bt, block):
  """Output ``[b, k, g, t, h]`` (fp32) and log-sum-exp ``[b, k, g, t]``."""
  b, t, k, g, h = q_btkgh.shape
  scale = h ** -0.5

  def step(carry, xs):
    m, l, acc = carry
    k_bjkh, v_bjkh, seg_bj, start = xs
    s, mask = _scores(q_btkgh, k_bjkh, seg_bt, seg_bj, start, scale)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    fix = jnp.exp(m - m_new)
    acc = acc * fix[..., None] + jnp.einsum('bkgtj,bjkh->bkgth', p.astype(v_bjkh.dtype), v_bjkh,
                                            preferred_element_type=jnp.float32)
    return (m_new, l * fix + p.sum(-1), acc), None

  starts = jnp.arange(0, k_bskh.shape[1], block)
  init = (jnp.full((b, k, g, t), _MASKED, jnp.float32), jnp.zeros((b, k, g, t), jnp.float32),
          jnp.zeros((b, k, g, t, h), jnp.float32))
  (m, l, acc), _ = jax.lax.scan(step, init, (_blocks(k_bskh, block), _blocks(v_bskh, block),
                                             _blocks(seg_bt, block), starts))
  return acc / l[..., None], m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q_btkgh, k_bskh, v_bskh, seg_bt, block):
  out, _ = _forward(q_btkgh, k_bskh, v_bskh, seg_bt, block)
  return out


def _attend_fwd(q_btkgh, k_bskh, v_bskh, seg_bt, block):
  out, lse = _forward(q_btkgh, k_bskh, v_bskh, seg_bt, block)
  return out, (q_btkgh, k_bskh, v_bskh, seg_bt, out, lse)


def _attend_bwd(block, res, dout):
  q_btkgh, k_bskh, v_bskh, seg_bt, out, lse = res
  scale = q_btkgh.shape[-1] ** -0.5
  delta = jnp.sum(dout * out, axis=-1)  # [b, k, g, t]
  dout = dout.astype(v_bskh.dtype)

  def step(dq, xs):
    k_bjkh, v_bjkh, seg_bj, start = xs
    s, mask = _scores(q_btkgh, k_bjkh, seg_bt, seg_bj, start, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    dv = jnp.einsum('bkgtj,bkgth->bjkh', p.astype(dout.dtype), dout,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum('bkgth,bjkh->bkgtj', dout, v_bjkh, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * scale).astype(q_btkgh.dtype)
    dq = dq + jnp.einsum('bkgtj,bjkh->btkgh', ds, k_bjkh, preferred_element_type=jnp.float32)
    dk = jnp.einsum('bkgtj,btkgh->bjkh', ds, q_btkgh, preferred_element_type=jnp.float32)
    return dq, (dk, dv)

  starts = jnp.arange(0, k_bskh.shape[1], block)
  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q_btkgh.shape, jnp.float32),
                              (_blocks(k_bskh, block), _blocks(v_bskh, block),
                               _blocks(seg_bt, block), starts))
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(k_bskh.shape).astype(k_bskh.dtype)
  return dq.astype(q_btkgh.dtype), unblock(dk), unblock(dv), None


_attend.defvjp(_attend_fwd, _attend_bwd)


def attend_blockwise(q_btnh, k_bskh, v_bskh, segments_bt, block: int):
  """Causal attention within documents, keys in blocks of ``block`` (divides the length)."""
  b, t, n, h = q_btnh.shape
  k = k_bskh.shape[2]
  if t % block:
    raise ValueError(f'sequence length {t} is not a multiple of model.attention_block={block}')
  q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
  out_bkgth = _attend(q_btkgh, k_bskh, v_bskh, segments_bt, block)
  return jnp.moveaxis(out_bkgth, 3, 1).reshape(b, t, n, h).astype(q_btnh.dtype)


def attend_splash(q_btnh, k_bskh, v_bskh, segments_bt, block: int, interpret: bool = False):
  """Causal attention within documents by the Pallas splash attention kernel (TPU).

  One device's share: the kernel runs on whole sequences of the local heads
  (models/transformer.py calls it through ``Ops.local``). The causal mask is
  static, so the kernel skips the key blocks above the diagonal; the document
  mask is the kernel's segment ids. Blocks of ``block`` positions (at most the
  length) for the forward pass and both backward kernels, as MaxText's
  ``sa_block_*`` defaults of 512. ``interpret=True`` runs the kernel's Pallas
  interpreter (on the CPU, in the tests). Grouped-query heads are the
  kernel's own: ``k`` and ``v`` keep their ``kv_heads``.
  """
  b, t, n, h = q_btnh.shape
  blk = min(block, t)
  sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk,
                            block_q_dkv=blk, block_kv_dkv=blk, block_kv_dkv_compute=blk,
                            block_q_dq=blk, block_kv_dq=blk)
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * n)
  kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [b, t, n, h] -> [b, n, t, h]
  q_bnth = heads_first(q_btnh * jnp.asarray(h ** -0.5, q_btnh.dtype))
  segments = splash.SegmentIds(q=segments_bt.astype(jnp.int32),
                               kv=segments_bt.astype(jnp.int32))
  out_bnth = jax.vmap(kernel)(q_bnth, heads_first(k_bskh), heads_first(v_bskh),
                              segment_ids=segments)
  return heads_first(out_bnth).astype(q_btnh.dtype)


def attend_cudnn(q_btnh, k_bskh, v_bskh, segments_bt, implementation: str = 'cudnn'):
  """Causal attention within documents by ``jax.nn.dot_product_attention`` (cuDNN on a GPU).

  ``is_causal`` lets cuDNN skip the key blocks above the diagonal. The document
  mask goes in as a boolean ``[b, 1, t, s]`` mask, which JAX hands to cuDNN as
  an additive bias in the compute dtype (2 bytes per query-key pair, shared by
  the heads; cuDNN's packed-segment layout is not reachable through this API).
  ``implementation='xla'`` runs the same call anywhere (the tests, on CPU).
  """
  same_doc_b1ts = (segments_bt[:, :, None] == segments_bt[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=same_doc_b1ts,
                                      is_causal=True, implementation=implementation)


def cudnn_refusal(dtype: str, head_dim: int, seq_len: int) -> str:
  """Why cuDNN's flash attention cannot run this model ('' when it can).

  Its limits (jax/_src/cudnn/fused_attention_stablehlo.py): fp16/bf16 inputs;
  head_dim a multiple of 8, at most 256 on Hopper (the H100 and H200 rows of
  parallelism/hardware.py); an even length when training with a mask (bias).
  """
  if dtype not in ('bfloat16', 'float16'):
    return f'model.dtype={dtype!r} (cuDNN takes bfloat16 or float16)'
  if head_dim % 8 or head_dim > 256:
    return f'model.head_dim={head_dim} (cuDNN takes multiples of 8 up to 256)'
  if seq_len % 2:
    return f'seq_len={seq_len} (cuDNN takes even lengths with a mask)'
  return ''


def splash_refusal(seq_len: int, block: int) -> str:
  """Why the splash kernel cannot run this length ('' when it can).

  Its blocks tile the sequence and the TPU's 128 lanes: min(block, seq_len)
  must divide the length and be a multiple of 128.
  """
  blk = min(block, seq_len)
  if seq_len % blk or blk % 128:
    return (f'seq_len={seq_len} with model.attention_block={block} (splash needs blocks of a '
            'multiple of 128 positions that divide the length)')
  return ''


def choose(attention: str, platform: str, dtype: str, head_dim: int, seq_len: int,
           block: int) -> str:
  """The implementation ``model.attention`` names on ``platform`` ('cpu', 'tpu', 'gpu').

  'auto' picks the platform's fused kernel where it runs the model: 'splash' on a
  TPU (MaxText's default there), 'cudnn' on a GPU (no ``[t, s]`` logits in
  memory); else 'blockwise' when the sequence spans several key blocks (the
  whole logits would be several times one block's: at seq 4096 on CPU it took
  0.18x the temporaries and 0.72x the time of 'xla', benchmarks/attention.py),
  else 'xla' (one block: nothing to save, and no recomputation in the backward
  pass). Raises ValueError for a kernel named where it cannot run.
  """
  kernels = {'cudnn': ('gpu', 'an NVIDIA GPU', cudnn_refusal(dtype, head_dim, seq_len)),
             'splash': ('tpu', 'a TPU', splash_refusal(seq_len, block))}
  if attention in kernels:
    where, device, refusal = kernels[attention]
    if platform != where:
      raise ValueError(f"model.attention={attention!r} runs on {device}, this run is on the "
                       f"{platform}: use 'auto', 'blockwise' or 'xla'")
    if refusal:
      raise ValueError(f"model.attention={attention!r} cannot run {refusal}: use 'auto', "
                       "'blockwise' or 'xla'")
  if attention != 'auto':
    return attention
  for name, (where, _, refusal) in kernels.items():
    if platform == where and not refusal:
      return name
  return 'blockwise' if seq_len > block and seq_len % block == 0 else 'xla'
