"""The seam between model code and the parallelism layer.

Model code names logical axes only (``('batch', 'length', 'embed')``). Every
place where an activation's layout matters, or where a dense layer multiplies
by a weight, goes through an :class:`Ops` object. The default one here is
layout-agnostic; ``parallelism`` supplies one that turns logical names into
mesh shardings (and, later, replaces einsums by decomposed collective einsums).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

Axes = tuple[str | None, ...]


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes, dtype: str, fan_in: int,
          scale: float = 1.0) -> nnx.Param:
  """A weight drawn from ``N(0, (scale / sqrt(fan_in))^2)``, named by its logical ``axes``.

  The axes are metadata only (``out_sharding``): ``parallelism.sharding``
  lays the weight out when the state is created sharded, not here.
  """
  init = jax.nn.initializers.normal(stddev=scale * fan_in ** -0.5)
  return nnx.Param(init(rngs.params(), shape, jnp.dtype(dtype)), out_sharding=axes,
                   eager_sharding=False)


def weight(w: jax.Array, dtype, grad_in_param_dtype: bool = False) -> jax.Array:
  """``w`` cast to the compute ``dtype``, its gradient left in that dtype.

  The gradient of a cast to bf16 is bf16; a plain ``astype`` converts it back to the
  weight's fp32 inside each layer, and a scan over the layers stacks those fp32
  gradients, a weight-sized buffer held through the backward pass. Left in bf16 they
  stack in half the bytes, with the same values (the conversion is exact): the train
  step converts them to the parameters' dtype (``trainer.step``), where the optimizer's
  update reads them. ``grad_in_param_dtype`` casts plainly (the program MaxText runs:
  the calibration rows). For weights used once per step (not a tied embedding, whose two
  uses' gradients add).
  """
  return w.astype(dtype) if grad_in_param_dtype else _cast_keep_grad(w, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cast_keep_grad(w: jax.Array, dtype) -> jax.Array:
  return w.astype(dtype)


def _cast_fwd(w, dtype):
  return w.astype(dtype), None


def _cast_bwd(dtype, _, g):
  del dtype
  return (g,)


_cast_keep_grad.defvjp(_cast_fwd, _cast_bwd)


def saved(x: jax.Array, name: str | None,
          parts: tuple[int, tuple[str, ...]] | None = None) -> jax.Array:
  """``x`` named for remat policies: whole as ``name``, or by ``parts`` = ``(dim, names)``,
  its equal parts along ``dim``.

  JAX rounds every saved residual (remat's partial evaluation). A plain einsum's rounding
  fuses into the einsum; a decomposed einsum's result is written block by block into a
  buffer, and rounded whole it is a pass of its own over that buffer. Named by the parts
  its consumers read (gate and up), each part's rounding fuses into them (dense_64b: ours
  4.501 -> 4.473 s a step; a plain einsum's named by parts, the baseline's is slower,
  5.019 -> 5.047 s; modeled).
  """
  if parts is None:
    return x if name is None else checkpoint_name(x, name)
  dim, names = parts
  return jnp.concatenate([checkpoint_name(p, n) for p, n in
                          zip(jnp.split(x, len(names), axis=dim), names)], axis=dim)


class Ops:
  """Layout-agnostic operations: constraints are no-ops, einsums are plain."""

  def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
    """Declares that ``x`` is laid out along logical ``axes``."""
    del axes
    return x

  def einsum(self, equation: str, x: jax.Array, w: jax.Array, *,
             x_axes: Axes, w_axes: Axes, out_axes: Axes,
             name: str, save_as: str | None = None,
             save_parts: tuple[int, tuple[str, ...]] | None = None,
             position_wise: tuple[tuple[str, ...], str] | None = None) -> jax.Array:
    """A dense layer's einsum ``x . w``; accumulates in at least fp32.

    Args:
      equation: einsum equation with shape letters, e.g. ``"btd,df->btf"``.
      x: activation.
      w: weight, already cast to the compute dtype.
      x_axes: logical axes of ``x``.
      w_axes: logical axes of ``w``.
      out_axes: logical axes of the result.
      name: the layer's path, used in reports.
      save_as: the result's name for remat policies (``checkpoint_name``).
      save_parts: ``(dim, names)``: the equal parts of the result along ``dim``, each
        named for remat policies instead, where the einsum is decomposed (``saved``).
      position_wise: ``(producers, consumer)``, layer paths, this one among them: the
        producers' results reach the consumer's ``x`` through position-wise work only
        (an MLP's activation). Where all of them are rings over one mesh axis, the
        sharded Ops leaves the blocks between them in the order the rings pass them
        (``ring.ring_position``), not put back in order; the results are the same.
    """
    del x_axes, w_axes, name, save_parts, position_wise
    out = jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)
    return saved(self.constrain(out.astype(x.dtype), out_axes), save_as)

  def local(self, fn, *args: jax.Array, in_axes: tuple[Axes, ...], out_axes: Axes) -> jax.Array:
    """Runs ``fn`` on each device's blocks of ``args`` (a kernel that cannot be partitioned).

    ``in_axes`` and ``out_axes`` name the logical axes of the arguments and of the
    result; an axis ``fn`` needs whole is written ``None``. Here ``fn`` sees the
    whole arrays; the sharded version runs it in a ``shard_map``.
    """
    del in_axes, out_axes
    return fn(*args)

  def experts(self, x_becd: jax.Array, expert_fn, *, chunks: int, flops: float,
              weight_bytes: float, name: str) -> jax.Array:
    """Runs ``expert_fn`` on tokens dispatched to experts.

    Args:
      x_becd: tokens in expert slots, ``[batch, exp, capacity, embed]``
        (logical axes ``models.moe.DISPATCHED``).
      expert_fn: maps ``[exp, batch, capacity, embed]`` to the same shape (axes
        ``models.moe.AT_EXPERTS``); it may be called once per chunk.
      chunks: how many capacity chunks a decomposed exchange may use.
      flops: the FLOPs of ``expert_fn`` on all of ``x_becd`` (for the cost model).
      weight_bytes: the bytes of all experts' weights in the compute dtype, which
        each call of ``expert_fn`` reads (for the cost model).
      name: the layer's path, used in reports.

    Returns:
      ``expert_fn``'s output back in ``[batch, exp, capacity, embed]``. Here a
      transpose; the sharded version moves tokens to the devices holding their
      experts (all-to-all) and back, whole or in chunks.
    """
    del chunks, flops, weight_bytes, name
    return jnp.swapaxes(expert_fn(jnp.swapaxes(x_becd, 0, 1)), 0, 1)
