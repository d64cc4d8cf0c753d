"""One kernel for a round of a bidirectional weight-gradient ring: both directions'
contributions from one read of the shared operand, each added to its arriving
accumulator as it is written.

A weight-gradient ring over ``fsdp`` sums, for each device's block of ``D`` rows of the
weight, every device's ``x[:, rows]^T y``. A bidirectional round makes two such
contributions (one per direction, for two blocks of rows) against the same ``y``, the
large operand (a cotangent or activation of every local token). As one einsum of the
two blocks joined, the compiler first copies the pair out of ``x`` and writes the joined
product, which is then split and added to the arriving accumulators in a pass of its
own (6 bytes an element in bf16: dense_500b, 0.304 s a step of additions and 0.108 s of
pair copies; docs/paper_scale.md). As an einsum a direction, ``y`` is read twice a round
and the round is HBM-bound. This Pallas kernel reads each block in place (the block
indices are prefetched scalars), reads ``y`` once for both, keeps both products in
fp32 in VMEM starting from the arriving accumulators, and writes the two sums, each in
its own buffer, ready to send.

Shapes (canonical; ``collective_einsum`` reshapes into them): ``xt`` ``[B, D, T]`` (the
sliced operand, its model dimension before its minor token dimension, as
a ring schedule's layout 'contiguous' lays it out), ``y`` ``[P, B, T, Q]`` (its last output
dimension ``Q`` minor, its others ``P`` major: gate/up's stacked pair, q/k/v's heads, as
the compiler lays out the cotangents that stack them), each accumulator one half of
``[P, rows, Q]`` (along ``P`` or ``Q``), as ``ring._in_halves`` sends them. On a CPU the
kernel runs in Pallas's interpreter (the tests); the TPU compiles it with Mosaic. It
declares its FLOPs and HBM bytes (``pl.CostEstimate``), which the step model reads
(``kernels.kernel_cost``), and its grid, which gets a parallel axis of 2 or more
wherever the shapes allow, so that both TensorCores of a v4 or v5p chip share it
(``_blocks``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from parallelism import kernels
from parallelism.hlo_text import KernelGrid

NAME = 'ring_pair_sums'  # the kernel's name in the compiled program
# What the kernel's blocks may take of a TPU core's VMEM: 14 of the 16 MiB the compiler
# lets a kernel use by default on v4 (more on later chips).
VMEM_BUDGET = 14 * 2**20


def _tiles(size: int, quantum: int) -> list[int]:
  """Valid block sizes along a dimension of ``size``, largest first: the multiples of
  ``quantum`` that divide it, or ``size`` itself (a whole dimension is always valid)."""
  return [t for t in range(size // quantum * quantum, 0, -quantum) if size % t == 0] or [size]


def _tile(size: int, target: int, quantum: int) -> int:
  """The largest of ``_tiles`` at most ``target``, else ``size``."""
  return next((t for t in _tiles(size, quantum) if t <= target), size)


def _blocks(p: int, q: int, rows: int, tt: int, itemsize: int,
            wire_itemsize: int) -> tuple[int, int]:
  """(P' a step, columns a step) for the grid, whose blocks of both are its parallel axes.

  Of the blocks whose buffers fit ``VMEM_BUDGET`` (both row blocks and ``y``'s block,
  double-buffered, both accumulators and both sums (double-buffered) and both fp32 sums
  in scratch; columns a multiple of 128 dividing ``q``, or ``q``): first those that keep
  both TensorCores of a v4 or v5p chip busy (a parallel axis of 2 or more, which Mosaic
  splits between them; without one a core idles: ``kernels.cores_used``), then the most
  of both (the fewest reads of each block of rows)."""
  fixed = 2 * 2 * rows * tt * itemsize
  per_element = 2 * tt * itemsize + 8 * rows * wire_itemsize + 2 * rows * 4  # of P' x cols
  fits = [(pc, tq) for tq in _tiles(q, 128) for pc in range(p, 0, -1)
          if p % pc == 0 and fixed + per_element * pc * tq <= VMEM_BUDGET]
  if not fits:
    raise ValueError(f'pair_sums: blocks of {rows} rows and {tt} tokens do not fit '
                     f'{VMEM_BUDGET} bytes of VMEM')
  cores = lambda f: kernels.cores_used(KernelGrid((p // f[0], q // f[1]), (True, True), ()), 2)
  return max(fits, key=lambda f: (cores(f), f[0] * f[1], f[0]))


def vmem_problem(b: int, t: int, d: int, p: int, q: int, n: int, halved: int, itemsize: int,
                 wire_itemsize: int) -> str:
  """Why ``pair_sums`` cannot run a ring of ``n`` over these operands (``kernel_form``'s
  B, T, D, P, Q and halved dimension), '' where it can: no blocks of its rows fit
  ``VMEM_BUDGET`` (decided when the ring is planned, not when it is traced)."""
  del b  # the grid's sum: any number of steps
  p_acc, q_acc = (p // 2, q) if halved == 0 else (p, q // 2)
  try:
    _blocks(p_acc, q_acc, d // n, _tile(t, 512, 128), itemsize, wire_itemsize)
  except ValueError as e:
    return str(e).removeprefix('pair_sums: ')
  return ''


def cost(xt_shape, acc_shape, itemsize: int, wire_itemsize: int,
         blocks: tuple[int, int]) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of one call: two ``[P', rows, Q']`` products over ``B x T``;
  ``y``'s half read once, both row blocks once per grid block of ``blocks`` (``P'`` and
  columns), both accumulators read and both sums written."""
  b, _, t = xt_shape
  p, rows, q = acc_shape
  flops = 2 * 2 * p * rows * b * t * q
  x_bytes = 2 * b * rows * t * itemsize * (p // blocks[0]) * (q // blocks[1])
  return flops, x_bytes + p * b * t * q * itemsize + 4 * p * rows * q * wire_itemsize


def pair_sums(xt: jax.Array, y: jax.Array, acc_a: jax.Array, acc_b: jax.Array,
              ka, kb, *, half: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """``(xt[:, ka rows]^T y[half] + acc_a, xt[:, kb rows]^T y[half] + acc_b)``, summed
  over ``B`` and ``T`` in fp32 and returned in the accumulators' dtype.

  ``xt`` is ``[B, D, T]``, ``y`` ``[P, B, T, Q]``, each accumulator ``[P', rows, Q']``:
  half of ``P`` (``P' = P / 2``) or of ``Q``, and ``half`` (0 or 1) says which. ``ka``
  and ``kb`` are block indices along ``D`` in units of ``rows``. Each step of the grid
  (blocks of ``P'`` and of columns, then ``B`` and token tiles, summed) takes as many of
  ``P'`` and columns as fit VMEM (``_blocks``), so each block of rows is read seldom.
  """
  b, d, t = xt.shape
  p, rows, q = acc_a.shape
  by_p = (2 * p, q) == (y.shape[0], y.shape[3])
  if (y.shape[1:3] != (b, t) or not (by_p or (p, 2 * q) == (y.shape[0], y.shape[3]))
      or acc_b.shape != acc_a.shape or d % rows):
    raise ValueError(f'pair_sums: xt {xt.shape}, y {y.shape}, accumulators '
                     f'{acc_a.shape} and {acc_b.shape} do not fit')
  tt = _tile(t, 512, 128)
  pc, tq = _blocks(p, q, rows, tt, xt.dtype.itemsize, acc_a.dtype.itemsize)
  # the half's first block along P, and its first column tile along Q
  hp, hq = (half * (p // pc), 0) if by_p else (0, half * (q // tq))
  ks = jnp.stack([jnp.asarray(ka, jnp.int32), jnp.asarray(kb, jnp.int32)])
  x_spec = lambda which: pl.BlockSpec((None, rows, tt),
                                      lambda i, c, k, j, ks: (k, ks[which], j))
  acc_spec = pl.BlockSpec((pc, rows, tq), lambda i, c, k, j, ks: (i, 0, c))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(p // pc, q // tq, b, t // tt),
      in_specs=[x_spec(0), x_spec(1),
                pl.BlockSpec((pc, None, tt, tq),
                             lambda i, c, k, j, ks: (hp + i, k, j, hq + c)),
                acc_spec, acc_spec],
      out_specs=[acc_spec, acc_spec],
      scratch_shapes=[pltpu.VMEM((pc, rows, tq), jnp.float32)] * 2)
  flops, bytes_ = cost(xt.shape, acc_a.shape, xt.dtype.itemsize, acc_a.dtype.itemsize,
                       (pc, tq))
  return pl.pallas_call(
      functools.partial(_kernel, steps=(b, t // tt)), grid_spec=grid_spec,
      # inside a shard_map, each sum varies over the manual axes as its accumulator does
      out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype, manual_axis_type=jax.typeof(a).mat)
                 for a in (acc_a, acc_b)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary', 'arbitrary')),
      cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=0,
                                    bytes_accessed=int(bytes_)),
      interpret=interpret, name=NAME)(ks, xt, xt, y, acc_a, acc_b)


def _kernel(ks_ref, xa_ref, xb_ref, y_ref, acc_a_ref, acc_b_ref, out_a_ref, out_b_ref,
            sum_a, sum_b, *, steps):
  del ks_ref  # used by the index maps only
  k, j = pl.program_id(2), pl.program_id(3)

  @pl.when((k == 0) & (j == 0))
  def _():
    sum_a[...] = acc_a_ref[...].astype(jnp.float32)
    sum_b[...] = acc_b_ref[...].astype(jnp.float32)

  xa, xb = xa_ref[...], xb_ref[...]
  for i in range(y_ref.shape[0]):  # every P' against the same two blocks of rows
    y = y_ref[i]
    sum_a[i] += jnp.dot(xa, y, preferred_element_type=jnp.float32)
    sum_b[i] += jnp.dot(xb, y, preferred_element_type=jnp.float32)

  @pl.when((k == steps[0] - 1) & (j == steps[1] - 1))
  def _():
    out_a_ref[...] = sum_a[...].astype(out_a_ref.dtype)
    out_b_ref[...] = sum_b[...].astype(out_b_ref.dtype)
