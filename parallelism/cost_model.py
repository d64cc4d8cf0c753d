"""A small analytical model of a decomposed collective einsum's time.

Its rates and formulas (the fitted constants, the max(FLOPs, bytes) rule, a ring step's
transfer, a group collective) are parallelism/pricing.py's, the step model's too
(parallelism/step_model.py, which prices the compiled program); "Where the step model
differs" below lists what this model prices otherwise, and why. For the decomposed axis of
size N, per device:

* ``T_comp``: the einsum's time on this device, ``max(F / peak, B / HBM
  bandwidth)`` with ``F`` its FLOPs and ``B`` the bytes it reads and writes;
  one ring step takes ``c = max(F / N / peak, b / HBM bandwidth) + a / HBM bandwidth``,
  where ``b`` is what the step's einsum reads and writes (its operand blocks and output
  part) and ``a`` what its partial-sum addition does, where partial sums accumulate: the
  einsum's partial sum written, then read with the accumulator and their sum written, in
  the wire dtype (an all-gather over a contracted dim: added to the accumulator; a
  reduce-scatter's: to the arriving one). The addition is priced after the einsum, as an
  instruction of its own, as the step model charges it where the compiled program runs it
  apart. Where the compiler fuses it into the einsum or the pair kernel runs it, this
  overcharges the step, which also stands in for the slices and updates around each step
  that this model does not price: across the eight paper configs its plans compile as fast
  as under the einsum's max or faster, but for two within 0.3% (docs/parallelism.md, the
  weight-gradient rings). A block sliced out of an operand
  along any dimension but its first is copied before the einsum: that copy's traffic adds to
  ``c`` (``_sliced_copy_bytes``). A ring whose steps are bound by
  that traffic while the plain einsum is not loses to ``none`` (``pricing.compute_seconds``;
  profiles without an HBM bandwidth, the CPU's, count FLOPs only). Operand and output
  sizes are what one device holds in the ring: an output whose partial sums
  are reduced over other axes after it (a weight gradient over ``fsdp``) is
  whole over them until then.
* ``t``: one ring step's transfer in one direction, a collective-permute of the block over
  one link, ``block bytes / link bandwidth + step latency`` (``pricing.permute_seconds``);
  the block is the gathered
  operand's local block (all-gathers) or a partial-sum block of the output in
  the accumulation dtype (reduce-scatter).
* The compiler's own collective (``pricing.ring_collective_seconds``: both directions of
  the ring, the axis taken as one torus dimension), ``T_comm = (N-1) (t - latency) / 2 +
  ceil((N-1)/2) latency``.

Predicted times (all modeled, not measured):

* ``none``: ``T_comp + T_comm`` — the collective, then the einsum.
* ``unidirectional``: ``c + (N-1) max(c, t)`` when the backend runs transfers
  asynchronously (each step the larger of its compute and its collective-permute, as the
  step model charges a compiled step: no launch cost of its own); otherwise nothing
  overlaps: ``T_comp + (N-1) t`` plus the per-step latency.
* ``bidirectional``: ``R = ceil((N-1)/2)`` rounds, each computing two blocks
  while both link directions carry one block each:
  ``c + R max(c2, t)``, ``c2`` the round's one einsum over both blocks
  (FLOPs 2F/N; the operand that stays is read once); under ``apart_pairs``
  (a ring schedule's ``pairs='apart'``) an all-gather's round is two einsums, each
  reading that operand, ``c2 = 2 c``. The joined round's copies (its blocks joined before
  the einsum, the product split after it) are not priced: which form a ring takes is the
  config's, by compiled programs (docs/paper_scale.md). For an even N the last round
  is the opposite device's block alone, half of it from each side (``ring.py``):
  ``c + (R-1) max(c2, t) + max(c, t/2)``, plus, for an
  all-gather, writing the two halves it forwards out of the blocks that hold them
  (a block's bytes read and written). Without async transfers ``T_comp + T_comm +
  R latency``.

So decomposition pays only when per-step compute hides per-step transfer, and
on the CPU profile (synchronous copies) never. A bidirectional ring is chosen over a
unidirectional one only where it models ``BIDIRECTIONAL_MIN_GAIN`` faster: it runs two
transfers a round and an even ring's halves, instructions whose launch and layout costs
the formulas above do not count, so a near tie goes to the simpler ring (the 500B's
``mlp.down`` forward: bidirectional modeled 0.1% faster, compiled 20 ms a step slower).

This mirrors XLA's own rule (spmd dot handler), which skips windowed einsum
when ``max(T_comp, m T_comm) + 2 m T_comm / N >= T_comp + T_comm``.

Where the step model differs, on purpose. Each of these, priced as the step model prices
it, moved decisions that then compiled slower (docs/paper_scale.md), or needs the compiled
schedule, which the planner does not have; the planner keeps its price until compiled
programs say otherwise:

* **An axis over several torus dimensions.** ``T_comm`` takes the axis as one dimension of
  N chips. The step model reads the chips' coordinates and charges a group spanning
  dimensions of extents ``n_1, n_2`` both directions of each (``ring_collective_seconds``
  with extents ``[n_1, n_2]``): over ``fsdp`` = 8 x 16, half the transfer time and 4 + 8
  steps of latency, not 64. Priced so (the span read from the mesh devices' coordinates),
  the planner moves 500B weight gradients that then compile slower on v4 (docs/parallelism.md,
  "Tried and not kept: the compiler's collective over every torus dimension").
* **Partial-sum additions** are priced after the einsum (``T_comp`` above); the step model
  charges them under the einsum where the compiled program fuses them into it or the pair
  kernel runs them, which the planner cannot see.
* **A bidirectional round's extra instructions**: its blocks joined before the einsum and
  the product split after it, the launch of its second transfer and of an even ring's
  halves, are not priced; the step model charges the copies, slices and permutes they
  compile to. ``BIDIRECTIONAL_MIN_GAIN`` stands in for them.
* **Other transfers on the same links.** Each einsum is priced alone: its ring and the
  compiler's collective have the links to themselves; in the step model transfers that
  share a link (the layer's FSDP gathers) take turns.
* **HBM at the data sheet's bandwidth**, as the step model at its fit (``hbm_efficiency``
  1.0); its band (``step_model.BAND``) also prices HBM at 0.85 of that, this model never.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from parallelism import hardware as hw, pricing
from parallelism.einsum_plan import AxisPlan, Equation

DEFAULT_HARDWARE = 'cpu'
BIDIRECTIONAL_MIN_GAIN = 0.01  # of the unidirectional ring's modeled time (module docstring)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Modeled seconds per device for each mode, and the per-step terms."""
  hardware: str
  axis: str
  n: int
  compute_seconds: float       # T_comp
  comm_seconds: float          # T_comm, the compiler's collective
  step_compute_seconds: float  # c
  step_transfer_seconds: float  # t
  seconds: dict[str, float]
  step_memory_bound: bool = False  # c is set by HBM traffic, not FLOPs
  round_compute_seconds: float = 0.0  # c2, a bidirectional round's einsum over two blocks

  def link_bound(self, mode: str) -> bool:
    """Whether a ring step (a round, bidirectional) in ``mode`` waits for its transfer:
    ``t`` outlasts its einsum's ``c`` (``c2``), so the ring hides only its own einsums."""
    return self.step_transfer_seconds > (
        self.round_compute_seconds if mode == 'bidirectional' else self.step_compute_seconds)

  @property
  def best_ring(self) -> str:
    """The faster ring: bidirectional only where it gains ``BIDIRECTIONAL_MIN_GAIN``."""
    uni, bi = self.seconds['unidirectional'], self.seconds['bidirectional']
    return 'bidirectional' if bi < (1 - BIDIRECTIONAL_MIN_GAIN) * uni else 'unidirectional'

  @property
  def best(self) -> str:
    """``none`` where no ring is faster, else ``best_ring``."""
    ring = self.best_ring
    return 'none' if self.seconds['none'] <= self.seconds[ring] else ring

  def as_dict(self) -> dict:
    return dataclasses.asdict(self) | {'best': self.best}


def estimate(eq: Equation, plan: AxisPlan, lhs_shape, rhs_shape, dtype, mesh,
             hardware, wire_fp32: bool = False, local=None, flops=None,
             apart_pairs: bool = False) -> Estimate:
  """Models ``none``, ``unidirectional`` and ``bidirectional`` for ``plan.axis``.

  ``local``: the elements of (lhs, rhs, output) one device holds in the ring
  (``decision.local_elements``); by default each global size over all
  devices, which undercounts an output whose partial sums are reduced after the
  ring (a weight gradient's, whole over ``fsdp`` until then). ``flops``: the einsum's
  FLOPs on one device (``decision.device_flops``); by default its FLOPs over
  all devices, which undercounts an einsum that an axis does not split. ``apart_pairs``: a
  bidirectional all-gather ring without partial sums runs an einsum a block.
  """
  profile = hardware if isinstance(hardware, hw.HardwareProfile) else hw.get_profile(hardware)
  sizes = {**dict(zip(eq.lhs, lhs_shape)), **dict(zip(eq.rhs, rhs_shape))}
  n = mesh.shape[plan.axis]
  shards = math.prod(mesh.shape.values())
  if flops is None:
    flops = 2 * math.prod(sizes.values()) / shards
  peak, link, hbm = pricing.rates(profile)
  itemsize = jnp.dtype(dtype).itemsize
  if local is None:
    local = tuple(math.prod(sizes[l] for l in letters) / shards
                  for letters in (eq.lhs, eq.rhs, eq.out))
  # partial sums travel in the compute dtype, or fp32 (parallelism.ring_dtype)
  wire = max(itemsize, 4) if wire_fp32 else itemsize
  blocks = dict(zip('lro', local))
  plain_bytes, (step_bytes, step_sums), (pair_bytes, pair_sums) = _hbm_bytes(
      eq, plan, blocks, n, itemsize, wire)
  if plan.kind == 'reducescatter':
    block = local[2] * wire
  else:
    block = local[0 if plan.gathered == 'lhs' else 1] * itemsize
  copied = _sliced_copy_bytes(eq, plan, blocks, n, itemsize)
  t_comp = pricing.compute_seconds(flops, plain_bytes, peak, hbm)
  # the einsum, then its block copy and partial-sum additions, each an instruction of its own
  c = pricing.compute_seconds(flops / n, step_bytes, peak, hbm) + (copied + step_sums) / hbm
  # one einsum over two blocks
  c2 = (pricing.compute_seconds(2 * flops / n, pair_bytes, peak, hbm) +
        (2 * copied + pair_sums) / hbm)
  if apart_pairs and plan.kind == 'allgather_free':
    c2 = 2 * c
  lat = profile.step_latency
  t = pricing.permute_seconds(block, link, lat)
  rounds = math.ceil((n - 1) / 2)
  t_comm = pricing.ring_collective_seconds(n * block, [n], link, profile.ring_links, lat)
  if profile.async_collectives:
    uni = c + (n - 1) * max(c, t)
    bi = c + rounds * max(c2, t)
    if n % 2 == 0 and n > 2:  # the last round: the opposite block alone, a half each way
      half = pricing.permute_seconds(block / 2, link, lat)
      bi = c + (rounds - 1) * max(c2, t) + max(c, half)
      if plan.kind != 'reducescatter':  # the halves it forwards are copies of its blocks
        bi += 2 * block / hbm
  else:
    uni = t_comp + (n - 1) * (t + lat)
    bi = t_comp + t_comm + rounds * lat
  return Estimate(profile.name, plan.axis, n, t_comp, t_comm, c, t,
                  {'none': t_comp + t_comm, 'unidirectional': uni, 'bidirectional': bi},
                  (step_bytes + step_sums) / hbm > flops / n / peak, c2)


def _sliced_copy_bytes(eq: Equation, plan: AxisPlan, local: dict, n: int,
                       itemsize: int) -> float:
  """Bytes a ring step writes and reads again to slice one block of the operand that stays
  on the device (a reduce-scatter's owner, along the scattered dim; an all-gather's other
  operand, along the contracted dim), or 0.

  Sliced along any dimension but its first, the block is strided: the compiler copies it
  into a buffer of its own before the einsum, as a separate instruction, so its time adds
  to the step's (dense_64b's scheduled program: its weight gradients' rings over ``fsdp``
  copy a [8, 2048, 128] block of x per step, 0.42 ms a layer for 1.25 ms of q/k/v's FLOPs).
  """
  if plan.kind == 'reducescatter':
    side, letter = ('l' if plan.out_letter in eq.lhs else 'r'), plan.out_letter
  elif plan.kind == 'allgather_contracting':
    side, letter = ('r' if plan.gathered == 'lhs' else 'l'), plan.letter
  else:
    return 0.0
  letters = eq.lhs if side == 'l' else eq.rhs
  return 0.0 if letters.index(letter) == 0 else 2 * itemsize * local[side] / n


def _hbm_bytes(eq: Equation, plan: AxisPlan, local: dict, n: int, itemsize: int,
               wire: int) -> tuple[float, tuple[float, float], tuple[float, float]]:
  """Bytes read and written per device by the plain einsum, and (by its einsum, by its
  partial-sum additions) for one ring step and for one bidirectional round (two blocks
  through one einsum, ``ring.py``: the operand that does not travel is read once, and the
  round's partial sum added once).

  ``local``: the elements of each operand's block on one device ('l', 'r', 'o');
  ``n`` the ring's size; ``wire`` the bytes of a partial sum's element. An addition writes
  the einsum's partial sum, reads it with the accumulator and writes their sum, all in the
  wire dtype: ``4 * wire`` bytes an element.
  """
  lhs, rhs, out = local['l'], local['r'], local['o']
  if plan.kind == 'reducescatter':  # the unreduced output, then its reduce-scatter
    owner, other = (lhs, rhs) if plan.out_letter in eq.lhs else (rhs, lhs)
    plain = itemsize * (lhs + rhs) + wire * n * out
    # slices of the owner and the other operand; each block's partial sum added to the
    # arriving accumulator
    step = lambda k: (itemsize * (k * owner / n + other), k * 4 * wire * out)
    return plain, step(1), step(2)
  g, o = (lhs, rhs) if plan.gathered == 'lhs' else (rhs, lhs)
  plain = itemsize * (n * g + o + out)  # the gathered operand, whole
  if plan.kind == 'allgather_free':  # blocks, the other operand, parts of the output
    step = lambda k: (itemsize * (k * g + o + k * out / n), 0.0)
    return plain, step(1), step(2)
  # allgather_contracting: blocks and slices of the other; the product added to the
  # accumulator once a step or round
  step = lambda k: (itemsize * k * (g + o / n), 4 * wire * out)
  return plain, step(1), step(2)
