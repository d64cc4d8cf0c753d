"""What the CPU benchmarks share: check their arguments, open the host's devices, time.

A benchmark checks every argument before JAX starts, so a bad one costs no start-up:

  error = prelude.at_least_one(args, 'repeats')
  if error:
    return prelude.refuse(error)
  prelude.start_cpu(8)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def at_least_one(args, *names: str) -> str | None:
  """``--NAME=VALUE must be at least 1`` for the first of ``names`` below 1; else None."""
  for name in names:
    value = getattr(args, name)
    if value < 1:
      return f'--{name}={value} must be at least 1'
  return None


def refuse(error: str) -> int:
  """Prints ``error`` as one line on stderr; returns the exit status of a bad argument, 2."""
  print(f'error: {error}', file=sys.stderr)
  return 2


def start_cpu(devices: int) -> None:
  """Opens the CPU as ``devices`` simulated devices (JAX_PLATFORMS=cpu unless it is set).

  Must run before JAX starts, after the arguments' checks.
  """
  sys.path.insert(0, ROOT)
  from trainer import runtime  # pylint: disable=g-import-not-at-top
  runtime.configure_host(devices, platform='cpu')


def time_alternating(fns, args, repeats: int) -> list[float]:
  """Median seconds of each of ``fns`` on ``args``, after one warm-up call each (which
  compiles), taking turns ``repeats`` times so that the machine's drift hits all alike."""
  import jax  # pylint: disable=g-import-not-at-top
  for fn in fns:
    jax.block_until_ready(fn(*args))
  times = [[] for _ in fns]
  for _ in range(repeats):
    for i, fn in enumerate(fns):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))  # one sharded computation in flight at a time
      times[i].append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]
