"""Ring and collective pricing: the one set of rates and formulas that the planner's cost
model (parallelism/cost_model.py, which prices an einsum before it is compiled) and the step
model (parallelism/step_model.py, which prices the compiled program) both use.

* **Rates.** A chip's matmuls run at ``MATMUL_EFFICIENCY`` of its data-sheet peak and its
  links carry ``LINK_EFFICIENCY`` of their data-sheet bandwidth: the step model's two
  fitted constants (its docstring, "Calibration"; ``python -m benchmarks.calibrate``). HBM
  runs at its data-sheet bandwidth. ``rates`` gives a hardware profile's.
* **Compute** (``compute_seconds``): an einsum, or one ring step of it, takes
  ``max(F / matmul rate, B / HBM bandwidth)`` for ``F`` matmul FLOPs and ``B`` bytes read
  and written: bound by its FLOPs or by its HBM traffic, whichever is slower.
* **A ring step's transfer** (``permute_seconds``): a collective-permute sends its buffer
  over one link, ``bytes / link rate + step latency``.
* **A group collective** (``ring_collective_seconds``) over chips spanning torus
  dimensions of extents ``n_1, n_2, ...`` (``G`` chips): ``(G-1)/G`` of the bytes moved cross
  both directions of the ring in every spanned dimension, plus the step latency for each
  sequential step, ``ceil((n-1)/2)`` per dimension.
"""

from __future__ import annotations

import math

from parallelism import hardware

# The step model's two fitted constants (step_model's docstring, "Calibration").
MATMUL_EFFICIENCY = 0.88  # fraction of the data-sheet peak a real chip's matmuls reach
LINK_EFFICIENCY = 1.0     # fraction of the data-sheet link bandwidth a collective reaches
CPU_NOMINAL_FLOPS = 25e9  # the CPU profile has no fixed peak; nothing overlaps there anyway


def rates(profile: hardware.HardwareProfile) -> tuple[float, float, float]:
  """(matmul FLOP/s, link bytes/s one direction, HBM bytes/s) of ``profile`` at the fitted
  constants, as the step model rates the compiled program (``step_model.Chip``); the CPU
  profile's matmuls (no peak in the table) at ``CPU_NOMINAL_FLOPS``, its memory traffic
  free (no HBM bandwidth in the table: FLOPs alone count)."""
  peak = profile.peak_flops * MATMUL_EFFICIENCY or CPU_NOMINAL_FLOPS
  return peak, profile.link_bandwidth * LINK_EFFICIENCY, profile.hbm_bandwidth or math.inf


def compute_seconds(flops: float, hbm_bytes: float, matmul_rate: float,
                    hbm_rate: float) -> float:
  """Compute that takes its FLOPs' time or its HBM traffic's, whichever is longer."""
  return max(flops / matmul_rate, hbm_bytes / hbm_rate)


def permute_seconds(nbytes: float, link_rate: float, latency: float) -> float:
  """A collective-permute (one ring step's transfer): ``nbytes`` over one link."""
  return nbytes / link_rate + latency


def ring_collective_seconds(moved: float, extents, link_rate: float, ring_links: int,
                            latency: float) -> float:
  """A collective over a group spanning torus dimensions of ``extents`` chips.

  ``(G-1)/G`` of ``moved`` bytes cross links: both directions of the ring in
  every spanned dimension, ``ring_links`` per direction, ``link_rate`` bytes/s
  each; plus ``latency`` per sequential step, ``ceil((n-1)/2)`` per dimension.
  The one formula for group collectives: the step model, the collective-einsum cost
  model (the compiler's collective of ``none``), the MoE all-to-all and launch.search's
  layout ranking use it.
  """
  g = math.prod(extents)
  if g < 2:
    return 0.0
  links = 2 * ring_links * max(1, len(extents))
  steps = sum(math.ceil((n - 1) / 2) for n in extents)
  return moved * (g - 1) / g / (links * link_rate) + steps * latency
