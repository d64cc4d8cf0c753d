"""Ring drivers for decomposed collectives, run inside ``jax.shard_map``.

Both drivers take this device's position ``idx`` on the ring (see
``ring_positions``) and the ring split ``(n_right, n_left)``: how many of the other
N-1 devices' contributions arrive through each direction of the ring.
Unidirectional is ``(N-1, 0)``: N-1 collective-permutes in sequence.
Bidirectional is ``(ceil((N-1)/2), floor((N-1)/2))``: two streams in opposite
directions, so about half as many sequential steps, each using both
directions of every link. In every step the permute of the next block is
issued before the einsum of the current one, and does not depend on it, so
an asynchronous backend overlaps the two; only the first (all-gather) or last
(reduce-scatter) transfer is exposed.

A bidirectional ring of an even N has one more block to move one way than the
other (the opposite device's: N/2 hops either way). That block travels in two
halves, one each way (``halves_dim``), so each direction carries N/2 - 1/2
blocks in N/2 transfers, not N/2 blocks one way and N/2 - 1 the other: the
longer direction, which a link-bound ring waits for, is half a block shorter.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import mlir

# The named scope of every decomposed einsum (``collective_einsum``), which the step model
# and ``launch.aot`` read from op_names to tell a ring's instructions from the compiler's.
RING_SCOPE = 'collective_einsum'
# The named scope of every addition of partial sums (``sum_rounded``): the step model
# reads it from the compiled program's op_names to cost those additions apart from the
# rest of a ring's non-matmul work (``step_model.compute_terms``).
ADDITIONS_SCOPE = 'partial_sums'

# ---- the output buffer of an all-gather ring ----------------------------------------

_fresh_p = jax.extend.core.Primitive('ring_buffer')
_fresh_p.def_abstract_eval(lambda after, *, shape, dtype: jax.core.ShapedArray(shape, dtype))


def _allocate(side_effect: bool):
  """A lowering to the compiler's uninitialized allocation (as ``lax.empty``'s)."""
  def lower(ctx, after, *, shape, dtype):
    del after, shape, dtype  # the buffer depends on ``after`` only in JAX's program
    op = mlir.ir.Operation.create(
        'stablehlo.custom_call',
        results=[mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])], operands=[],
        attributes={'call_target_name': mlir.ir.StringAttr.get('AllocateBuffer'),
                    'has_side_effect': mlir.ir.BoolAttr.get(side_effect)})
    return op.results
  return lower


mlir.register_lowering(_fresh_p, mlir.lower_fun(
    lambda after, *, shape, dtype: [jnp.zeros(shape, dtype)], multiple_results=True))
mlir.register_lowering(_fresh_p, _allocate(side_effect=True), 'tpu')  # tests/test_tpu_aot.py
mlir.register_lowering(_fresh_p, _allocate(side_effect=False), 'gpu')  # as lax.empty


def fresh_buffer(shape, dtype, *, after: jax.Array) -> jax.Array:
  """An uninitialized array (``lax.empty``; zeros on CPU) allocated where it is used.

  ``lax.empty`` depends on nothing, so JAX hoists it out of a layer scan, and the
  compiler then copies that one allocation into every iteration before the ring writes
  its blocks into it (dense_64b: ours' compute 3.720 -> 3.686 s without that copy; moe_1t:
  ours 3.752 -> 3.738 s; modeled). This one depends on ``after`` (never read), so it
  stays where ``after`` is computed, and on TPU is marked as having a side effect, so
  that the compiler does not hoist it either (on GPU, where no compiled program has been
  checked, it lowers as ``lax.empty`` does).
  """
  return _fresh_p.bind(after, shape=tuple(shape), dtype=jnp.dtype(dtype))


# ---- ring drivers -------------------------------------------------------------------


def ring_split(n: int, bidirectional: bool) -> tuple[int, int]:
  """(n_right, n_left) for a ring of ``n`` devices."""
  if not bidirectional:
    return n - 1, 0
  return n // 2, (n - 1) // 2


def ring_positions(n: int) -> jax.Array:
  """An int32 array of the ring positions, to pass into the shard_map as P(axis).

  Inside, element 0 of the local block is this device's position. This avoids
  ``jax.lax.axis_index``, whose partition-id XLA refuses to partition when the
  shard_map is manual over some axes only and its operands' layouts on the
  other axes come from propagation (seen in a train step whose loss ends in a
  logsumexp over vocab-sharded logits).
  """
  return jnp.arange(n, dtype=jnp.int32)


def recv_from(x: jax.Array, axis: str, n: int, offset: int) -> jax.Array:
  """Device j receives the value of device (j + offset) mod n."""
  return jax.lax.ppermute(x, axis, [((j + offset) % n, j) for j in range(n)])


def _loop(lo: int, hi: int, body, carry, unroll: int | bool):
  """``fori_loop`` over ring steps; ``unroll=True`` gives every step its own ops."""
  if hi <= lo:
    return carry
  return jax.lax.fori_loop(lo, hi, body, carry,
                           unroll=True if unroll is True else min(unroll, hi - lo))


def all_gather_einsum(shard: jax.Array, consume: Callable, acc, *, axis: str, n: int,
                      idx: jax.Array, split: tuple[int, int], unroll: int = 1,
                      consume_pair: Callable | None = None):
  """Folds every device's ``shard`` into ``acc`` without an all-gather.

  ``consume(acc, block, src)`` folds in the block that device ``src`` holds
  (writes an einsum at its offset, or adds a partial sum). A bidirectional
  step holds two blocks; ``consume_pair(acc, a, src_a, b, src_b)`` folds both
  with one einsum (as XLA's windowed einsum does), else ``consume`` runs twice.
  A block is passed on only once the previous round's einsum is done (``waiting_for``),
  so each round's einsum runs while the next blocks travel: left free, the TPU
  compiler's scheduler ran some rounds' transfers back to back with nothing between
  (dense_500b's q/k/v forward ring: 0.093 s a step exposed; docs/paper_scale.md).
  """
  if consume_pair is None:
    consume_pair = lambda acc, a, sa, b, sb: consume(consume(acc, a, sa), b, sb)
  n_right, n_left = split
  at = lambda s: (idx + s) % n
  acc = consume(acc, shard, idx)
  if n == 1:
    return acc
  right = recv_from(shard, axis, n, +1)
  left = recv_from(shard, axis, n, -1) if n_left else None

  def both(s, carry):  # blocks idx+s and idx-s in hand; fetch the next two
    acc, right, left = carry
    # passed on once the previous round's einsum is done: this round's overlaps the transfer
    r_, l_ = waiting_for((right, left), acc)
    nxt_r, nxt_l = recv_from(r_, axis, n, +1), recv_from(l_, axis, n, -1)
    return consume_pair(acc, right, at(s), left, at(-s)), nxt_r, nxt_l

  def right_only(s, carry):
    acc, right = carry
    nxt = recv_from(waiting_for(right, acc), axis, n, +1)
    return consume(acc, right, at(s)), nxt

  start = 1
  if n_left:
    acc, right, left = _loop(1, n_left, both, (acc, right, left), unroll)
    if n_right == n_left:  # the last round holds blocks +-n_left: one einsum
      return consume_pair(acc, right, at(n_left), left, at(-n_left))
    dim = halves_dim(shard) if n_right == n_left + 1 else None
    if dim is not None:  # the opposite block, idx + n_right: one half from each side
      r_, l_ = waiting_for((right, left), acc)
      first = recv_from(jnp.split(r_, 2, dim)[0], axis, n, +1)
      second = recv_from(jnp.split(l_, 2, dim)[1], axis, n, -1)
      acc = consume_pair(acc, right, at(n_left), left, at(-n_left))
      return consume(acc, jnp.concatenate([first, second], dim), at(n_right))
    nxt = recv_from(right, axis, n, +1)  # block n_left + 1; no more from the left
    acc, right = consume_pair(acc, right, at(n_left), left, at(-n_left)), nxt
    start = n_left + 1
  acc, right = _loop(start, n_right, right_only, (acc, right), unroll)
  return consume(acc, right, at(n_right))


def all_gather_apart(shard: jax.Array, consume: Callable, *, axis: str, n: int,
                     idx: jax.Array, dim: int, ring_order: bool = False) -> jax.Array:
  """A unidirectional all-gather ring with no loop whose results are joined once.

  ``consume(block)`` maps each device's block, as it passes, to its part of the result
  (an einsum); the parts, in the order they arrived (this device's first), are joined
  along ``dim`` and rolled so that device k's part sits at offset k. Written into a
  buffer one by one instead, each part left the einsum in its own layout and was copied
  into the buffer's before the write (dense_64b's gate/up ring; docs/paper_scale.md); the
  join writes the whole result once, in the layout its readers take. With
  ``ring_order`` the parts stay in the order they arrived (``ring_position``), not rolled:
  the roll wrote the result twice over (dense_64b: 0.028 s a step).
  """
  parts = [consume(shard)]
  nxt = recv_from(shard, axis, n, +1) if n > 1 else None
  for s in range(1, n):  # block idx + s arrives; the next is fetched before its einsum
    block, nxt = nxt, (recv_from(nxt, axis, n, +1) if s < n - 1 else None)
    parts.append(consume(block))
  joined = jnp.concatenate(parts, dim)
  if n == 1 or ring_order:
    return joined
  return jnp.roll(joined, idx * parts[0].shape[dim], axis=dim)


def ring_position(k, idx, n: int, ring_order: bool):
  """Where device ``k``'s block sits along the ring's dimension of an array that device
  ``idx`` holds whole: at ``k``, or, in ring order, at ``(k - idx) mod n`` (the order an
  all-gather ring's blocks arrive in from the right, this device's own first)."""
  return (k - idx) % n if ring_order else k


def halves_dim(x: jax.Array) -> int | None:
  """The dimension along which an even bidirectional ring splits the opposite device's
  block into the halves that travel one each way: the first of even size (the most
  major, so each half is contiguous), or None (the block travels whole, one way)."""
  return next((d for d, size in enumerate(x.shape) if size % 2 == 0), None)


def waiting_for(x, token):
  """``x``, as a value the compiler cannot compute before ``token`` exists.

  Orders a ring's work against its transfers where the TPU compiler's scheduler would
  not. A reduce-scatter ring's contributions depend on nothing in flight, so the
  scheduler computed them all at the start of the ring, leaving its last transfers
  nothing to overlap (dense_64b: the backward gate/up rings' exposure was 0.155 s a
  step, 0.127 s with the wait; modeled): given the accumulator sent beside it, each
  contribution is computed while that accumulator travels. An all-gather ring passes a
  block on only after the previous round's einsum (``all_gather_einsum``).
  """
  return jax.lax.optimization_barrier((x, token))[0]


def _unfused(x: jax.Array) -> jax.Array:
  """Keeps the compiler from fusing the accumulator add into the einsum.

  Fused, the einsum would wait for the incoming accumulator, and nothing
  would overlap its transfer (seen in the TPU schedule).
  """
  return jax.lax.optimization_barrier(x)


def reduce_scatter_einsum(partial: Callable, *, axis: str, n: int, idx: jax.Array,
                          split: tuple[int, int], unroll: int = 1,
                          pair_axis: int | None = None, last_apart: bool = False,
                          laid_out: Callable = lambda x: x,
                          halves_axis: int | None = None,
                          pair_sums: Callable | None = None) -> jax.Array:
  """Sums ``partial(block)`` over all devices into device ``block``'s output.

  ``partial(k, after=acc)`` is this device's contribution to output block k, not
  computed before ``acc`` exists (``waiting_for``; ``after=None``: whenever).
  Accumulators travel the ring and each device adds its contribution as one passes;
  each contribution waits for the accumulator sent beside it, never for a transfer.
  With ``last_apart`` so does this device's own block's (``_last``). ``laid_out`` is
  applied to every accumulator as it is made (a layout constraint).
  Accumulators travel, and rest between steps, in the dtype ``partial`` returns
  (bf16 for a bf16 model: half the bytes on the wire and in HBM); every
  addition runs in fp32 (at least) and rounds once. A bidirectional step
  computes two contributions: with ``pair_axis``, ``partial(k1, k2)`` gives both
  from one einsum, concatenated along that dimension, else ``partial`` runs
  twice. With ``halves_axis``, each accumulator travels as two halves along that
  output dimension that take turns (``_in_halves``; an odd bidirectional ring's travel
  whole), and each step's einsum adds its half's arriving accumulator as it writes:
  ``partial(k, half=j)`` gives half ``j`` of block k's contribution, in fp32.
  ``pair_sums(k1, k2, half=j, accs=(a1, a2), after=...)``, where given, computes a
  bidirectional round's two halves ``j`` and adds them to the arriving ``a1`` and ``a2``
  itself, returning both sums (``parallelism/pair_sums.py``).
  """
  def partial_pair(k1, k2, barrier=lambda x: x, after=None):
    if pair_axis is None:
      return barrier((partial(k1, after=after), partial(k2, after=after)))
    # The barrier holds the joined product, so each half is read where it is added
    # (a slice fused into the addition), not copied out first.
    return tuple(jnp.split(barrier(partial(k1, k2, after=after)), 2, axis=pair_axis))

  n_right, n_left = split
  at = lambda s: (idx + s) % n
  add = lambda *xs: laid_out(sum_rounded(*xs))
  if n == 1:
    return partial(idx)

  def step_r(s, acc_r):
    return add(recv_from(acc_r, axis, n, -1), _unfused(partial(at(n_right - s), after=acc_r)))

  # An even ring: the opposite block's contribution leaves in halves, one each way; both
  # accumulators then make n_right hops.
  dim = halves_dim(jax.eval_shape(partial, idx)) if n_left and n_right == n_left + 1 else None
  if dim is not None:
    half_r, half_l = jnp.split(partial(at(n_right)), 2, dim)
    # Each half arrives into a whole block of zeros (a pad, fused into the addition: no
    # copy of the joined block).
    size = half_r.shape[dim]
    widen = lambda x, lo: jnp.pad(x, [(lo, size - lo) if d == dim else (0, 0)
                                      for d in range(x.ndim)])
    in_r = widen(recv_from(half_r, axis, n, -1), 0)
    in_l = widen(recv_from(half_l, axis, n, +1), size)
    if halves_axis is not None:
      ways = ((-1, lambda s: at(n_right - s)), (+1, lambda s: at(s - n_right)))
      return _in_halves(partial, idx, axis, n, ways, (in_r, in_l), (1, n_right), halves_axis,
                        (half_r, half_l), last_apart, unroll, add, pair_sums)
    mine_r, mine_l = partial_pair(at(n_right - 1), at(1 - n_right), _unfused,
                                  after=(half_r, half_l))
    acc_r, acc_l = add(mine_r, in_r), add(mine_l, in_l)
    acc_r, acc_l = _loop(2, n_right, _both_steps(partial_pair, at, axis, n, n_right, n_right,
                                                 add), (acc_r, acc_l), unroll)
    return _last(partial, idx, axis, n, acc_r, acc_l, last_apart, add)
  if n_left:  # accumulators that move right (n_right hops) and left (n_left hops)
    acc_r, acc_l = partial_pair(at(n_right), at(-n_left))
    acc_r, acc_l = _loop(1, n_left, _both_steps(partial_pair, at, axis, n, n_right, n_left,
                                                add), (acc_r, acc_l), unroll)
  elif halves_axis is not None:
    return _in_halves(partial, idx, axis, n, ((-1, lambda s: at(n - 1 - s)),), (None,),
                      (0, n - 1), halves_axis, None, last_apart, unroll, add)
  else:
    acc_r = partial(at(n_right))  # moves right: n_right hops to its owner
  acc_r = _loop(max(n_left, 1), n_right, step_r, acc_r, unroll)
  return _last(partial, idx, axis, n, acc_r, acc_l if n_left else None, last_apart, add)


def _in_halves(partial, idx, axis: str, n: int, ways, arriving, rounds: tuple[int, int],
               dim: int, after, last_apart: bool, unroll, add, pair_sums=None):
  """A reduce-scatter ring whose accumulators travel as two halves along output dimension
  ``dim``, one transfer apart.

  ``ways``: for each direction (one, or two for a bidirectional ring), the offset it
  receives from and round s's block; ``arriving``: what each adds in the first of
  ``rounds`` (None: nothing); ``after``: what that round's einsums wait for. Each round
  sends the first halves, computes the second halves' steps (their einsums adding the
  second halves' accumulators, which arrived the round before), sends those, and computes
  the first halves' steps once theirs have arrived: each transfer overlaps the other
  halves' einsums, and no addition but the last (this device's own block's, as
  ``_last``'s) is a pass of its own: apart, each reads and writes 6 bytes an element in
  bf16 (dense_500b: 0.130 s a step; docs/paper_scale.md). Each einsum reads half of the
  operand it does not slice, split where it waits (``partial``'s ``after``), so that the
  compiler reads the halves in place rather than copying them out of the loop. A
  bidirectional round computes each direction's halves with an einsum of its own: one
  einsum for both (``pair_axis``) would write them joined, to be copied apart; or, with
  ``pair_sums``, both directions' halves and their additions in one kernel.
  """
  wire = jax.eval_shape(partial, idx).dtype
  recv = lambda accs: tuple(recv_from(a, axis, n, off) for a, (off, _) in zip(accs, ways))
  halves = lambda accs, j: tuple(a if a is None else jnp.split(a, 2, dim)[j] for a in accs)

  def step_of(s, j, arrived, wait):  # round s's half j of every direction
    if pair_sums is not None and len(ways) == 2:
      return tuple(pair_sums(*[block(s) for _, block in ways], half=j, accs=arrived,
                             after=wait))
    made = [partial(block(s), half=j, after=wait) for _, block in ways]
    return tuple(m.astype(wire) if a is None else add(a, m) for a, m in zip(arrived, made))

  first, last = rounds
  second = step_of(first, 1, halves(arriving, 1), after)
  sent = step_of(first, 0, halves(arriving, 0), second)  # computed while the second travels

  def step(s, carry):
    sent, arrived = carry  # the first halves' accumulators, sent now; the second's, here
    nxt = recv(step_of(s, 1, arrived, carry))
    return step_of(s, 0, recv(sent), carry), nxt

  sent, arrived = _loop(first + 1, last, step, (sent, recv(second)), unroll)
  joined = [jnp.concatenate(pair, dim) for pair in zip(recv(sent), arrived)]
  mine = partial(idx, after=(sent, arrived))
  return add(joined[0], _unfused(mine) if last_apart else mine, *joined[1:])


def _both_steps(partial_pair, at, axis: str, n: int, right: int, left: int, add):
  """A bidirectional round ``s``: the right-moving accumulator of block ``right - s`` and
  the left-moving one of block ``s - left`` arrive and take this device's contributions,
  computed while they travel; ``add`` sums each pair."""
  def both(s, carry):
    acc_r, acc_l = carry
    mine_r, mine_l = partial_pair(at(right - s), at(s - left), _unfused, after=(acc_r, acc_l))
    return (add(recv_from(acc_r, axis, n, -1), mine_r),
            add(recv_from(acc_l, axis, n, +1), mine_l))
  return both


def _last(partial, idx, axis: str, n: int, acc_r, acc_l, apart: bool, add):
  """This device's own block: the arriving accumulators and its own contribution, summed
  by ``add``.

  The compiler fuses that contribution's einsum with the additions (and with what
  follows the ring, such as the next RMSNorm's sums) into one pass that waits for the
  last transfers. ``apart`` keeps it out (``_unfused``), computed while they travel
  (dense_500b's ``attn.o`` and ``mlp.down``: 0.032 s a step less exposed, 0.016 s more
  compute; modeled, docs/paper_scale.md).
  """
  sent = (acc_r, acc_l) if acc_l is not None else acc_r
  mine = partial(idx, after=sent)
  last = [recv_from(acc_r, axis, n, -1), _unfused(mine) if apart else mine]
  if acc_l is not None:
    last.append(recv_from(acc_l, axis, n, +1))
  return add(*last)


def sum_rounded(*xs: jax.Array) -> jax.Array:
  """The sum of ``xs`` computed in fp32 (or wider), rounded once to their dtype."""
  with jax.named_scope(ADDITIONS_SCOPE):
    acc = jnp.promote_types(xs[0].dtype, jnp.float32)
    total = xs[0].astype(acc)
    for x in xs[1:]:
      total = total + x.astype(acc)
    return total.astype(xs[0].dtype)
