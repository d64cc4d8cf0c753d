"""Tuning by measurement (``parallelism.tune=measure``): each layer's form timed on the devices.

No cost model survives every chip and compiler version; where the devices are at hand the
fastest form of each layer can be measured instead. Before the first step, for every
distinct dense layer (its equation, operand shapes and specs), the candidate forms are
compiled and timed, forward and backward, a few milliseconds each:

* the plain einsum (the compiler's collectives),
* a unidirectional and a bidirectional ring over the axis the planner picked,
* the planner's own decision (``explain`` under the run's policy),

each ring with the planner's schedule (``parallelism/schedule.py``). The cost model only
proposes; the fastest measured form runs, and its measured times stay in the plan (the
report's ``measured_ms``, plan.json). Every process times every candidate, and the
slowest process's time of each decides, so all processes run one plan and compile one
program. Only layers whose form is the planner's to choose are measured
(``left_to_planner``): a form the config sets is kept. On CPU nothing overlaps: a ring
measured faster there wins by the plain form's lowering or by noise, not by hiding a
transfer (docs/collective_einsum.md); the measurement there checks the machinery, not the
technique.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from parallelism import moe
from parallelism.collective_einsum import run_decision
from parallelism.decision import Decision, explain

# Each candidate, after its compile and a warm-up call, is timed for at least REPEATS calls
# and BUDGET seconds (at most MAX_ROUNDS calls); its least time counts.
REPEATS, BUDGET, MAX_ROUNDS = 5, 0.03, 100


def candidates(decision: Decision, shapes, specs, dtype, *, mesh, policy) -> dict[str, Decision]:
  """The forms tried for a layer planned as ``decision``: label -> decision."""
  out = {'planned': decision}
  kw = dict(mesh=mesh, lhs_spec=specs[0], rhs_spec=specs[1], out_spec=specs[2],
            hardware=policy.hardware, ring_dtype=policy.ring_dtype,
            prefer=dict(policy.prefer))
  for mode in ('none', 'unidirectional', 'bidirectional'):
    try:
      d = explain(decision.equation, *shapes, dtype, mode=mode, **kw)
    except ValueError:  # no ring can run this layer's einsum
      continue
    if all(d.program() != o.program() for o in out.values()):
      out[mode] = d
  return out


def compiled(decision: Decision, shapes, specs, dtype, mesh):
  """The layer's forward and both gradients as ``decision`` runs them, compiled and run
  once, with random operands: ``(step, args)``, timed as ``step(*args)``."""
  kw = dict(mesh=mesh, lhs_spec=specs[0], rhs_spec=specs[1], out_spec=specs[2])
  keys = jax.random.split(jax.random.key(0), 2)
  args = [jax.device_put(jax.random.normal(k, s, jnp.float32).astype(dtype),
                         NamedSharding(mesh, spec))
          for k, s, spec in zip(keys, shapes, specs)]
  loss = lambda x, w: jnp.sum(run_decision(decision, x, w, **kw).astype(jnp.float32))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  jax.block_until_ready(step(*args))  # compiles and warms up
  return step, args


def seconds(decisions, shapes, specs, dtype, mesh) -> list[float]:
  """Each decision's least time of its calls, the candidates taking turns (so a change in
  the machine's load reaches them all). A first round sets how many follow: enough for
  each to run ``BUDGET`` seconds, at least ``REPEATS``, at most ``MAX_ROUNDS``; the
  processes agree on it (each call is a collective every process must join)."""
  runs = [compiled(d, shapes, specs, dtype, mesh) for d in decisions]

  def one_round():
    took = []
    for step, args in runs:
      start = time.perf_counter()
      jax.block_until_ready(step(*args))
      took.append(time.perf_counter() - start)
    return np.array(took)

  best = one_round()
  slowest = float(np.max(multihost_utils.process_allgather(best)))
  for _ in range(int(np.clip(BUDGET / slowest, REPEATS, MAX_ROUNDS))):
    best = np.minimum(best, one_round())
  return list(map(float, best))


def left_to_planner(path: str, policy) -> bool:
  """Whether layer ``path``'s form is the planner's to choose, so measuring may change it:
  ``collective_matmul='auto'`` and no ``layer_overrides`` entry other than ``auto`` for it.
  A form the config sets (always, never, an override) is the user's, never replaced."""
  entry = policy.override(path)
  return policy.collective_matmul == 'auto' and (entry is None or entry[1] == 'auto')


def measure(plan: Mapping[str, Any], dtype, *, mesh, policy,
            log: Callable[[str], None] = print) -> dict:
  """``plan`` (``sharding.plan_layers``'s, before ring orders are set) with each dense
  layer's form the fastest measured (module docstring); its decision's ``measured`` holds
  every candidate's seconds."""
  start = time.perf_counter()
  groups: dict[tuple, list[str]] = {}
  dense = [p for p, layer in plan.items() if not isinstance(layer.decision, moe.ExchangeDecision)]
  fixed = [p for p in dense if not left_to_planner(p, policy)]
  for path in dense:
    layer = plan[path]
    if path not in fixed:
      groups.setdefault((layer.decision.equation, layer.specs, layer.shapes), []).append(path)
  if fixed:
    log(f'tune: {len(fixed)} layer(s) keep the form the config sets, not measured '
        f'(collective_matmul={policy.collective_matmul!r} or layer_overrides)')
  out, tried = dict(plan), 0
  for k, ((equation, specs, shapes), paths) in enumerate(groups.items()):
    first = plan[paths[0]].decision
    forms = candidates(first, shapes, specs, dtype, mesh=mesh, policy=policy)
    local = np.array(seconds(list(forms.values()), shapes, specs, dtype, mesh))
    # the slowest process's time of each candidate: every process picks the same one
    agreed = np.max(multihost_utils.process_allgather(local).reshape(-1, len(forms)), axis=0)
    times = dict(zip(forms, map(float, agreed)))
    best = min(times, key=lambda f: (times[f], f != 'planned'))
    tried += len(forms)
    log(f'tune: {k + 1}/{len(groups)} {equation} {list(map(list, shapes))} ({len(paths)} '
        'layer(s)): ' + ', '.join(f'{f} {s * 1e3:.2f} ms' for f, s in times.items())
        + f' -> {best}')
    measured = tuple(sorted(times.items()))
    for path in paths:
      chosen = forms[best] if best != 'planned' else plan[path].decision
      out[path] = plan[path]._replace(decision=dataclasses.replace(
          chosen, measured=measured,
          reason=chosen.reason + f'; measured fastest of {len(forms)} forms ({best})'))
  log(f'tune: measured {tried} forms of {len(groups)} layer shapes in '
      f'{time.perf_counter() - start:.1f} s before step 1')
  return out
