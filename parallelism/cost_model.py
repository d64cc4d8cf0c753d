"""A small analytical model of a decomposed collective einsum's time.

For the decomposed axis of size N, per device:

* ``T_comp``: the einsum's FLOPs on this device / peak FLOP/s; one ring step
  computes ``c = T_comp / N``.
* ``t``: one ring step's transfer in one direction, ``block bytes / (link
  bandwidth x ring links) + step latency``; the block is the gathered
  operand's local block (all-gathers) or a partial-sum block of the output in
  the accumulation dtype (reduce-scatter).
* The compiler's own collective uses both directions of the ring:
  ``T_comm = (N-1) (t - latency) / 2 + (N-1) latency``.

Predicted times (all modeled, not measured):

* ``none``: ``T_comp + T_comm`` — the collective, then the einsum.
* ``unidirectional``: ``c + (N-1) (max(c, t) + latency)`` when the backend runs
  transfers asynchronously (the extra latency is the per-step einsum and
  update launch); otherwise nothing overlaps: ``T_comp + (N-1) t`` plus the
  per-step latency.
* ``bidirectional``: ``R = ceil((N-1)/2)`` rounds, each computing two blocks
  while both link directions carry one block each:
  ``c + R (max(2c, t) + latency)``; without async transfers
  ``T_comp + T_comm + R latency``.

So decomposition pays only when per-step compute hides per-step transfer, and
on the CPU profile (synchronous copies) never.

This mirrors XLA's own rule (spmd dot handler), which skips windowed einsum
when ``max(T_comp, m T_comm) + 2 m T_comm / N >= T_comp + T_comm``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from parallelism import hardware as hw
from parallelism.einsum_plan import AxisPlan, Equation

DEFAULT_HARDWARE = 'cpu'
CPU_NOMINAL_FLOPS = 25e9  # the CPU profile has no fixed peak; nothing overlaps there anyway


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

  @property
  def best(self) -> str:
    return min(self.seconds, key=self.seconds.get)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self) | {'best': self.best}


def estimate(eq: Equation, plan: AxisPlan, lhs_shape, rhs_shape, dtype, mesh,
             hardware, wire_fp32: bool = False) -> Estimate:
  """Models ``none``, ``unidirectional`` and ``bidirectional`` for ``plan.axis``."""
  profile = hardware if isinstance(hardware, hw.HardwareProfile) else hw.get_profile(hardware)
  sizes = {**dict(zip(eq.lhs, lhs_shape)), **dict(zip(eq.rhs, rhs_shape))}
  n = mesh.shape[plan.axis]
  shards = math.prod(mesh.shape.values())
  flops = 2 * math.prod(sizes.values()) / shards
  peak = profile.peak_flops or CPU_NOMINAL_FLOPS
  itemsize = jnp.dtype(dtype).itemsize
  if plan.kind == 'reducescatter':
    # the accumulator travels in the compute dtype, or fp32 (parallelism.ring_dtype)
    block = math.prod(sizes[l] for l in eq.out) / shards * (max(itemsize, 4) if wire_fp32
                                                            else itemsize)
  else:
    letters = eq.lhs if plan.gathered == 'lhs' else eq.rhs
    block = math.prod(sizes[l] for l in letters) / shards * itemsize
  t_comp = flops / peak
  c = t_comp / n
  t = block / (profile.link_bandwidth * profile.ring_links) + profile.step_latency
  lat = profile.step_latency
  rounds = math.ceil((n - 1) / 2)
  t_comm = (n - 1) * ((t - lat) / 2 + lat)
  if profile.async_collectives:
    uni = c + (n - 1) * (max(c, t) + lat)
    bi = c + rounds * (max(2 * c, t) + lat)
  else:
    uni = t_comp + (n - 1) * (t + lat)
    bi = t_comp + t_comm + rounds * lat
  return Estimate(profile.name, plan.axis, n, t_comp, t_comm, c, t,
                  {'none': t_comp + t_comm, 'unidirectional': uni, 'bidirectional': bi})
