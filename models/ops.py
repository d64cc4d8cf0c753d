"""The seam between model code and the parallelism layer.

Model code names logical axes only (``('batch', 'length', 'embed')``). Every
place where an activation's layout matters, or where a dense layer multiplies
by a weight, goes through an :class:`Ops` object. The default one here is
layout-agnostic; ``parallelism`` supplies one that turns logical names into
mesh shardings (and, later, replaces einsums by decomposed collective einsums).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Axes = tuple[str | None, ...]


class Ops:
  """Layout-agnostic operations: constraints are no-ops, einsums are plain."""

  def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
    """Declares that ``x`` is laid out along logical ``axes``."""
    del axes
    return x

  def einsum(self, equation: str, x: jax.Array, w: jax.Array, *,
             x_axes: Axes, w_axes: Axes, out_axes: Axes,
             name: str) -> jax.Array:
    """A dense layer's einsum ``x . w``; accumulates in at least fp32.

    Args:
      equation: einsum equation with shape letters, e.g. ``"btd,df->btf"``.
      x: activation.
      w: weight, already cast to the compute dtype.
      x_axes: logical axes of ``x``.
      w_axes: logical axes of ``w``.
      out_axes: logical axes of the result.
      name: the layer's path, used in reports.
    """
    del x_axes, w_axes, name
    out = jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)
    return self.constrain(out.astype(x.dtype), out_axes)

  def local(self, fn, *args: jax.Array, in_axes: tuple[Axes, ...], out_axes: Axes) -> jax.Array:
    """Runs ``fn`` on each device's blocks of ``args`` (a kernel that cannot be partitioned).

    ``in_axes`` and ``out_axes`` name the logical axes of the arguments and of the
    result; an axis ``fn`` needs whole is written ``None``. Here ``fn`` sees the
    whole arrays; the sharded version runs it in a ``shard_map``.
    """
    del in_axes, out_axes
    return fn(*args)

  def experts(self, x_becd: jax.Array, expert_fn, *, chunks: int, flops: float,
              name: str) -> jax.Array:
    """Runs ``expert_fn`` on tokens dispatched to experts.

    Args:
      x_becd: tokens in expert slots, ``[batch, exp, capacity, embed]``
        (logical axes ``models.moe.DISPATCHED``).
      expert_fn: maps ``[exp, batch, capacity, embed]`` to the same shape (axes
        ``models.moe.AT_EXPERTS``); it may be called once per chunk.
      chunks: how many capacity chunks a decomposed exchange may use.
      flops: the FLOPs of ``expert_fn`` on all of ``x_becd`` (for the cost model).
      name: the layer's path, used in reports.

    Returns:
      ``expert_fn``'s output back in ``[batch, exp, capacity, embed]``. Here a
      transpose; the sharded version moves tokens to the devices holding their
      experts (all-to-all) and back, whole or in chunks.
    """
    del chunks, flops, name
    return jnp.swapaxes(expert_fn(jnp.swapaxes(x_becd, 0, 1)), 0, 1)
