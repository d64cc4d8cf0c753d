"""Decomposed collective einsums: the technique this framework is built on.

``collective_einsum(equation, lhs, rhs, mesh=..., lhs_spec=..., rhs_spec=...,
out_spec=...)`` computes ``jnp.einsum(equation, lhs, rhs)`` for operands laid
out as ``lhs_spec``/``rhs_spec`` and returns it laid out as ``out_spec``. The
collective the layout implies along one mesh axis (an all-gather before the
einsum, or a reduce-scatter after it) is decomposed together with the einsum
into a ring of collective-permutes and partial einsums (parallelism/ring.py),
so that on TPU/GPU each transfer overlaps the previous step's compute.

Other mesh axes are left to the compiler: the ring runs in a ``shard_map``
that is manual over the decomposed axis only. The gradient is decomposed too:
the transpose of an all-gather einsum is an einsum reduce-scatter and vice
versa, and the custom VJP calls this function for both operand gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import layout
from jax.sharding import NamedSharding, PartitionSpec

from parallelism import cost_model, einsum_plan, pair_sums, ring, schedule
from parallelism import hardware as hw
from parallelism.einsum_plan import AxisPlan, Equation

MODES = ('none', 'unidirectional', 'bidirectional', 'always', 'auto')
# What a ring's partial sums travel and rest in: the compute dtype (bf16 for a bf16
# model: half the bytes; each device still adds in fp32) or float32.
RING_DTYPES = ('compute', 'float32')
# Which weight-gradient rings may hold the gradient whole over an axis it is reduced over
# afterwards (fsdp): 'any' (the cost model's fastest form), or 'sharded' (no such ring: an
# all-gather ring over the forward's axis whose accumulator is the local gradient whole
# over fsdp; the gradient rings over fsdp or is one einsum, for models tight on memory).
GRADIENT_ACCUMULATORS = ('any', 'sharded')
# Which layers' gradients auto may ring (``explain``): only those whose forward rings, or
# also those whose forward is left to the compiler (``_gradients_alone``).
GRADIENT_RINGS = ('ringed_forward', 'any_forward')
# The mode of a weight gradient's ring over the forward's axis (``_backward_forms``).
WEIGHT_GRADIENT_MODE = 'bidirectional'
DECOMPOSABLE = ('allgather_free', 'allgather_contracting', 'reducescatter')
SCOPE = ring.RING_SCOPE


class _Priced(NamedTuple):
  """What of a ring's settings its price depends on (``cost_model.estimate``)."""
  wire_fp32: bool     # partial sums travel in fp32 (ring_dtype='float32')
  apart_pairs: bool   # a two-way all-gather round an einsum a block (RingSchedule.pairs)


@dataclasses.dataclass(frozen=True)
class Decision:
  """What ``collective_einsum`` did, and why (see ``explain``)."""
  equation: str
  mode: str                      # none | unidirectional | bidirectional
  axis: str | None               # the decomposed mesh axis
  collective: str | None         # the AxisPlan kind of that axis
  left_to_compiler: tuple[str, ...]  # other axes that need a collective
  estimate: cost_model.Estimate | None
  reason: str
  # How the gradients of (lhs, rhs) run when decomposed: 'ring' (the transposed
  # einsum decomposed over the same axis) or 'none' (one einsum over an operand the
  # compiler gathers once: auto's choice where the ring's steps would be HBM-bound).
  backward: tuple[str, str] = ('ring', 'ring')
  # (axis, mode) of a gradient's ring where it runs over another axis than the forward's
  # (a weight gradient over ``fsdp``, where the compiler's reduce-scatter of its partial
  # sums would block the chip) or in another mode (a weight gradient's ring bidirectional
  # beside a unidirectional forward): ``_backward_forms``.
  backward_over: tuple[tuple[str, str] | None, tuple[str, str] | None] = (None, None)
  # Each gradient's (lhs, rhs) forms under auto, with the modeled seconds that chose
  # between them (``_backward_forms``): 'one einsum' or 'MODE over AXIS', each with the
  # compiler's collectives over the axes it leaves, and "compiler's collective over AXIS".
  gradient_seconds: tuple[dict[str, float], dict[str, float]] = ({}, {})
  # Which of (lhs, rhs, out) holds its blocks along the ring's dimension in the order the
  # rings pass them ('' none): set by the layer plan for an einsum of a position-wise
  # chain (``sharding.plan_layers``, ``ring_order_fits``); ``run_decision`` honours it.
  ring_order: str = ''
  # What partial sums travel and rest in (RING_DTYPES), and each ring's schedule: the
  # forward's, the lhs gradient's and the rhs gradient's (None: that einsum is no ring).
  ring_dtype: str = 'compute'
  schedules: tuple[schedule.RingSchedule | None, ...] = (None, None, None)
  # Under parallelism.tune=measure, each form tried and its seconds on the devices
  # (forward and both gradients, the slowest process's): ``parallelism/tune.py``.
  measured: tuple[tuple[str, float], ...] = ()

  @property
  def decomposed(self) -> bool:
    """Whether any of its einsums runs as a ring: the forward, or a gradient alone (a
    weight gradient over ``fsdp`` beside a plain forward)."""
    return self.mode != 'none' or any(self.backward_over)

  def gradient(self, which: int) -> str:
    """How gradient ``which`` (0: lhs, 1: rhs) runs: 'ring', 'MODE over AXIS' or 'none'."""
    other = self.backward_over[which]
    return f'{other[1]} over {other[0]}' if other and self.backward[which] == 'ring' else \
        self.backward[which]


def explain(equation, lhs_shape, rhs_shape, dtype, *, mesh, lhs_spec, rhs_spec, out_spec,
            mode='auto', hardware=None, ring_dtype='compute',
            gradient_accumulators='any', gradient_rings='ringed_forward',
            prefer: Mapping[str, Any] | None = None) -> Decision:
  """Decides how ``collective_einsum`` would run, without running it: the mode, the axis,
  the gradients' forms and each ring's schedule (``parallelism/schedule.py``; ``prefer``:
  schedule settings to use instead of the planner's, where they apply, as a plan file or
  a test sets them).

  Raises:
    ValueError: for an explicit mode that cannot be honoured, naming the specs, or a bad
      ``prefer``.
  """
  prefer = schedule.check_prefer(prefer)
  pairs = prefer.get('pairs')
  if mode == 'always' and 'direction' in prefer:
    mode = prefer['direction']
  overlapped = (hardware if isinstance(hardware, hw.HardwareProfile) else hw.get_profile(
      hardware or cost_model.DEFAULT_HARDWARE)).async_collectives
  decision = _decide(equation, lhs_shape, rhs_shape, dtype, mesh, (lhs_spec, rhs_spec, out_spec),
                     mode, hardware, ring_dtype, gradient_accumulators, gradient_rings,
                     pairs or ('apart' if overlapped else 'joined'), overlapped)
  return with_schedules(decision, lhs_shape, rhs_shape, mesh=mesh, lhs_spec=lhs_spec,
                        rhs_spec=rhs_spec, out_spec=out_spec, hardware=hardware, prefer=prefer)


def _decide(equation, lhs_shape, rhs_shape, dtype, mesh, all_specs, mode, hardware, ring_dtype,
            gradient_accumulators, gradient_rings, gather_pairs, overlapped) -> Decision:
  """``explain``'s mode, axis and gradient forms, before the rings' schedules."""
  lhs_spec, rhs_spec, out_spec = all_specs
  if mode not in MODES:
    raise ValueError(f'mode={mode!r} is not one of {MODES}')
  if ring_dtype not in RING_DTYPES:
    raise ValueError(f'ring_dtype={ring_dtype!r} is not one of {RING_DTYPES}')
  if gradient_accumulators not in GRADIENT_ACCUMULATORS:
    raise ValueError(f'gradient_accumulators={gradient_accumulators!r} is not one of '
                     f'{GRADIENT_ACCUMULATORS}')
  if gradient_rings not in GRADIENT_RINGS:
    raise ValueError(f'gradient_rings={gradient_rings!r} is not one of {GRADIENT_RINGS}')
  alone = gradient_rings == 'any_forward'
  form = _Priced(ring_dtype == 'float32', gather_pairs == 'apart')
  eq, plans = einsum_plan.plan(equation, lhs_spec, rhs_spec, out_spec)
  # An axis of size 1 needs no collective whatever the specs say.
  needs = [p for p in plans if p.kind != 'pass' and mesh.shape[p.axis] > 1]
  specs = f'lhs {lhs_spec}, rhs {rhs_spec}, out {out_spec}'
  shapes = (lhs_shape, rhs_shape)
  problems = {p.axis: _problem(eq, p, shapes, all_specs, mesh) for p in needs}
  ok = [p for p in needs if not problems[p.axis]]
  chosen = _choose_axis(eq, ok, shapes, all_specs, dtype, mesh, hardware, form) if ok \
      else None
  estimate = chosen and _estimate(eq, chosen, shapes, all_specs, dtype, mesh,
                                  hardware or cost_model.DEFAULT_HARDWARE, form)
  others = tuple(p.axis for p in needs if p is not chosen)
  if mode == 'none':
    return Decision(str(eq), 'none', None, chosen and chosen.kind, others, estimate,
                    'mode="none"', ring_dtype=ring_dtype)
  if chosen is None:
    why = '; '.join(problems.values()) or 'no mesh axis needs a collective'
    if mode != 'auto':
      raise ValueError(f'cannot decompose {eq} with mode="{mode}": {why} ({specs})')
    return _gradients_alone(
        Decision(str(eq), 'none', None, None, others, None, f'fallback to none: {why}',
                 ring_dtype=ring_dtype),
        eq, shapes, all_specs, dtype, mesh, hardware, form, alone)
  backward, backward_over = ('ring', 'ring'), (None, None)
  if mode == 'auto':
    choice = estimate.best
    reason = f'cost model ({estimate.hardware}) picks {choice}' + (
        ' (ring steps bound by HBM traffic)' if estimate.step_memory_bound else '')
    if choice == 'none':
      return _gradients_alone(
          Decision(str(eq), 'none', None, chosen.kind, others, estimate, reason,
                   ring_dtype=ring_dtype),
          eq, shapes, all_specs, dtype, mesh, hardware, form, alone)
    if choice == 'unidirectional' and (estimate.seconds['bidirectional']
                                       < estimate.seconds['unidirectional']):
      reason += (f' (bidirectional models less than {cost_model.BIDIRECTIONAL_MIN_GAIN:.0%} '
                 'faster: the simpler ring)')
    rings, seconds = _backward_forms(eq, chosen.axis, choice, shapes, all_specs, dtype, mesh,
                                     hardware, form, gradient_accumulators == 'sharded')
    backward = tuple('none' if r is None else 'ring' for r in rings)
    backward_over = tuple(None if r is None or r == (chosen.axis, choice) else r
                          for r in rings)
    for which, r, forms in zip(('lhs', 'rhs'), rings, seconds):
      if r is None and len(forms) > 1 + sum(k.startswith("compiler's") for k in forms):
        reason += f'; gradient of {which} as one einsum (its ring would be slower)'
      elif r is None:  # no ring was priced
        reason += f'; gradient of {which} as one einsum (no ring can run it' + (
            ": under gradient_accumulators='sharded' not the one over "
            f'{chosen.axis}' if gradient_accumulators == 'sharded' else '') + ')'
      elif r[0] != chosen.axis:
        reason += _blocking(which, r)
      elif r[1] != choice:
        reason += (f'; gradient of {which} {r[1]} (beside the next layer\'s gradient '
                   'rings, on both link directions)')
    return Decision(str(eq), choice, chosen.axis, chosen.kind, others, estimate, reason,
                    backward, backward_over, seconds, ring_dtype=ring_dtype)
  choice, reason = mode, f'mode="{mode}"'
  if mode == 'always':  # a ring in the direction the cost model prefers where rings overlap
    choice = estimate.best_ring if overlapped else 'unidirectional'
    reason = f'mode="always": {choice}' + ('' if overlapped else ' (nothing overlaps on '
                                                                  f'{estimate.hardware})')
  return Decision(str(eq), choice, chosen.axis, chosen.kind, others, estimate, reason,
                  ring_dtype=ring_dtype)


def with_schedules(decision: Decision, lhs_shape, rhs_shape, *, mesh, lhs_spec, rhs_spec,
                   out_spec, hardware=None, prefer: Mapping[str, Any] | None = None) -> Decision:
  """``decision`` (``explain``'s, perhaps with its forms changed) with its rings' schedules
  chosen anew for them: the planner's, each field of ``prefer`` instead where it applies."""
  profile = hardware if isinstance(hardware, hw.HardwareProfile) else hw.get_profile(
      hardware or cost_model.DEFAULT_HARDWARE)
  return _scheduled(decision, (lhs_shape, rhs_shape), (lhs_spec, rhs_spec, out_spec), mesh,
                    profile, schedule.check_prefer(prefer))


def _scheduled(decision: Decision, shapes, specs, mesh, profile, prefer) -> Decision:
  """``decision`` with the schedule of each ring it runs (``schedule.choose``)."""
  if not decision.decomposed:
    return decision
  cfg = _static(decision, specs, mesh)
  eq = Equation.parse(decision.equation)
  sizes = {**dict(zip(eq.lhs, shapes[0])), **dict(zip(eq.rhs, shapes[1]))}
  out_shape = tuple(sizes[l] for l in eq.out)
  rings = ((cfg, shapes, decision.mode != 'none'),
           (cfg.transposed('lhs'), (out_shape, shapes[1]), decision.backward[0] == 'ring'),
           (cfg.transposed('rhs'), (shapes[0], out_shape), decision.backward[1] == 'ring'))
  gather = _gather_first_spec(cfg) is not None
  schedules = tuple(
      schedule.choose(_ring_facts(c, s, i, gather and i == 2, profile.platform),
                      profile.async_collectives, prefer)
      if runs and _is_ring(c) else None for i, (c, s, runs) in enumerate(rings))
  return dataclasses.replace(decision, schedules=schedules)


def ring_einsums(decision: Decision, specs) -> tuple[tuple[str, str] | None, ...]:
  """(equation, AxisPlan kind) of each ring ``decision`` runs (forward, lhs gradient, rhs
  gradient; None: no ring), the equation as the ring's scope names it in HLO
  (``SCOPE/KIND/DIRECTION/EQUATION``)."""
  cfg = _static(decision, specs, None)
  rings = (cfg, cfg.transposed('lhs'), cfg.transposed('rhs'))
  return tuple((c.equation, _axis_plan(c)[1].kind) if sc is not None else None
               for c, sc in zip(rings, decision.schedules))


def _is_ring(cfg: _Static) -> bool:
  """Whether ``cfg``'s einsum runs as a ring (``_transpose_einsum``'s test)."""
  if cfg.axis is None:
    return False
  _, plans = einsum_plan.plan(cfg.equation, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  return any(p.axis == cfg.axis and p.kind in DECOMPOSABLE for p in plans)


def _ring_facts(cfg: _Static, shapes, index: int, gather: bool,
                platform: str) -> schedule.RingFacts:
  """What decides which schedule settings apply to the ring ``cfg`` runs on operands of
  ``shapes`` (ring ``index``: 0 the forward's, 1 and 2 the gradients')."""
  cfg, *shapes = _gathered_dims_major(cfg, *shapes)
  eq, plan = _axis_plan(cfg)
  specs = hoisted_specs(eq, cfg.axis, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  manual = (cfg.axis,) + _manual_extra(cfg, eq, *specs)
  local = [_local_shape(shape, spec, manual, cfg.mesh) for shape, spec in zip(shapes, specs)]
  fused_fits, problem = False, 'an all-gather ring'
  if plan.kind == 'reducescatter':
    z = plan.out_letter
    (owner, other), other_letters = ((local, eq.rhs) if z in eq.lhs else
                                     (local[::-1], eq.lhs))
    fused_fits = _halved_letter(eq, z, other_letters, other) is not None
    problem = _kernel_problem(cfg, eq, z, manual, owner, other)
  return schedule.RingFacts(plan.kind, cfg.bidirectional, cfg.activation_out, index == 0,
                            fused_fits, problem, gather, platform, cfg.mesh.shape[cfg.axis])


def _kernel_problem(cfg: _Static, eq: Equation, z: str, manual, owner_shape,
                    other_shape) -> str:
  """Why the pair kernel (``_pair_kernel_ring``) cannot run a reduce-scatter ring ('' where
  it can): an even two-way weight-gradient ring whose shard_map holds every mesh axis of
  size > 1 manual (a Mosaic kernel needs all of them manual), in ``_kernel_form``'s shapes."""
  n = cfg.mesh.shape[cfg.axis]
  others = [a for a in cfg.mesh.axis_names if a not in manual and cfg.mesh.shape[a] > 1]
  if cfg.activation_out:
    return 'its output is an activation'
  if not cfg.bidirectional or n % 2:
    return 'not an even two-way ring'
  if others:
    return f'mesh axis {others[0]} is not manual in its shard_map'
  if _kernel_form(eq, z, owner_shape, other_shape) is None:
    return "its operands are not [contracted..., sliced] and [contracted..., output's]"
  return ''


def _local_shape(shape, spec, manual, mesh) -> tuple[int, ...]:
  """The block of a ``shape`` array laid out as ``spec`` that a shard_map manual over
  ``manual`` hands each device."""
  spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  return tuple(d // math.prod(mesh.shape[a] for a in einsum_plan.axes_of(e) if a in manual)
               for d, e in zip(shape, spec))


def _gradients_alone(plain: Decision, eq: Equation, shapes, specs, dtype, mesh, hardware,
                     form: _Priced, enabled: bool) -> Decision:
  """``plain`` (a forward left to the compiler, under auto), with each gradient einsum
  that reduce-scatters over an axis as a ring over it where the cost model says that
  ring costs less than the compiler's reduce-scatter, which blocks the chip; only where
  ``enabled`` (``gradient_rings='any_forward'``).

  A weight gradient under FSDP with a data axis (the batch over ``(data, fsdp)``): the
  forward's weight gather over ``fsdp`` is the compiler's, prefetched, but the gradient's
  reduce-scatter over ``fsdp`` is synchronous; its ring sums the batch's partial products
  over ``fsdp`` block by block, and the compiler then sums its block over ``data``. Not by
  default: the cost model picks these rings where they lose, as it takes the rings' extra
  compute for less and the compiler's reduce-scatters for more than the compiled programs
  show (modeled, compiled: v5p ``dense_64b``, data=8 x fsdp=64, 4.383 -> 4.266 s a step;
  ``dense_10b``, data=4 x fsdp=32, v4 1.200 -> 1.229 s, v5p 1.330 -> 1.340 s;
  docs/paper_scale.md).
  """
  if not enabled:
    return plain
  rings, seconds = _backward_forms(eq, None, None, shapes, specs, dtype, mesh, hardware,
                                   form)
  if not any(rings):
    return dataclasses.replace(plain, gradient_seconds=seconds)
  reason = plain.reason + ''.join(_blocking(w, r) for w, r in zip(('lhs', 'rhs'), rings) if r)
  return dataclasses.replace(plain, reason=reason, backward_over=rings, gradient_seconds=seconds,
                             backward=tuple('ring' if r else 'none' for r in rings))


def _blocking(which: str, ring: tuple[str, str]) -> str:
  """The reason's words for gradient ``which`` on a ring over another axis than the
  forward's."""
  return (f'; gradient of {which} {ring[1]} over {ring[0]} (the compiler\'s reduce-scatter '
          f'over {ring[0]} would block)')


def _backward_forms(eq: Equation, axis: str | None, mode: str | None, shapes, specs, dtype,
                    mesh, hardware, form: _Priced, sharded: bool = False):
  """(axis, mode) of each gradient einsum's ring (of lhs, rhs), or None: one einsum; and
  the modeled seconds of each one's forms (``Decision.gradient_seconds``).

  The candidates are one einsum, the ring over the forward's ``axis`` (in its ``mode``)
  and a ring over any other axis over which the gradient einsum reduce-scatters (a weight
  gradient over ``fsdp``, in that ring's best mode). Each is costed as its ring (or its
  einsum) plus the transfers of the collectives it leaves to the compiler: a reduce-scatter
  blocks the chip (synchronous under the TPU flags), an all-gather of the cotangent is
  waited for, and an all-gather of one of the forward's inputs, though the compiler
  prefetches it asynchronously, holds the links of the forward's axis while the other
  gradient's ring runs over them, so the two take turns (the step model's ``links``; 64B's
  ``mlp.gate_up``: x's gather over tensor queued the data gradient's ring behind it; counted,
  its weight gradient rings over tensor: 64B 4.700 -> 4.649 s a step, 500B 8.027 -> 7.859 s,
  modeled). The least wins; ties go to the forward's ring.

  The weight's gradient (of ``rhs``, the weight in ``Ops.einsum``) rings over the forward's
  axis bidirectionally whatever the forward's mode (``WEIGHT_GRADIENT_MODE``): it is off
  the critical path, and the scheduler runs it beside the next layer's data-gradient
  rings, which use both directions of the same links; unidirectional, all its transfers
  queue on one of them (dense_64b's ``mlp.gate_up`` weight gradient beside ``attn.o``'s
  data gradient: 0.125 s a step exposed; bidirectional, 0.047 s, the step 4.437 -> 4.342
  s, modeled).

  The cotangent's gather over the forward's axis is counted even where the data
  gradient's ring hands it on whole (``keeps_cotangent``), which the forms other than the
  forward's ring then save: not counting it moved dense_500b's ``attn.o`` weight gradient
  from the ring over tensor to the one over fsdp, 7.834 s a step against 7.773 s
  (modeled): the fsdp ring's 128 short steps cost more than the model says.

  Under ``sharded`` (``GRADIENT_ACCUMULATORS``) an all-gather ring over the forward's
  axis is no candidate where the gradient is reduced over another axis afterwards: its
  accumulator would hold the gradient whole over that axis.

  With ``axis`` None (a forward left to the compiler, ``_gradients_alone``) the candidates
  are one einsum and the rings over the axes a gradient einsum reduce-scatters over.
  """
  sizes = {**dict(zip(eq.lhs, shapes[0])), **dict(zip(eq.rhs, shapes[1]))}
  out_shape = tuple(sizes[l] for l in eq.out)
  lhs_spec, rhs_spec, out_spec = specs
  transposed = {'lhs': (f'{eq.out},{eq.rhs}->{eq.lhs}', (out_spec, rhs_spec, lhs_spec),
                        (out_shape, shapes[1])),
                'rhs': (f'{eq.lhs},{eq.out}->{eq.rhs}', (lhs_spec, out_spec, rhs_spec),
                        (shapes[0], out_shape))}
  rings, seconds = [], {'lhs': {}, 'rhs': {}}
  for which, (equation, t_specs, t_shapes) in transposed.items():
    t_eq, plans = einsum_plan.plan(equation, *t_specs)
    plan = next((p for p in plans if p.axis == axis), None) if axis else None
    if axis and (plan is None or plan.kind not in DECOMPOSABLE):
      rings.append((axis, mode))  # the compiler's collective either way (_transpose_einsum)
      continue
    others = [p for p in plans if p.kind == 'reducescatter' and p.axis != axis and
              mesh.shape[p.axis] > 1 and
              not _problem(t_eq, p, t_shapes, t_specs, mesh, alone=False)]
    candidates = ([plan] if plan else []) + others
    if not candidates:
      rings.append(None)
      continue
    own_ring = plan is not None and not (
        sharded and plan.kind == 'allgather_contracting' and any(
            p.kind == 'reducescatter' and p.axis != axis and mesh.shape[p.axis] > 1
            for p in plans))
    est = {p.axis: _estimate(t_eq, p, t_shapes, t_specs, dtype, mesh, hardware, form)
           for p in candidates}
    # The compiler's collective over each axis, where the ring runs over another one.
    compiler = {p.axis: est[p.axis].comm_seconds for p in candidates}
    left = lambda a: sum(s for b, s in compiler.items() if b != a)
    own = WEIGHT_GRADIENT_MODE if which == 'rhs' and plan and mesh.shape[axis] > 2 else mode
    total = {(axis, own): est[axis].seconds[own] + left(axis)} if own_ring else {}
    for p in others:
      m = est[p.axis].best_ring
      total[p.axis, m] = est[p.axis].seconds[m] + left(p.axis)
    plain = est[candidates[0].axis].compute_seconds + sum(compiler.values())
    best = min(total, key=lambda r: (total[r], r[0] != axis), default=None)  # ties: forward's
    rings.append(best if best and total[best] <= plain else None)
    seconds[which] = {'one einsum': plain, **{f'{m} over {a}': s for (a, m), s in total.items()},
                      **{f"compiler's collective over {a}": s for a, s in compiler.items()}}
  return tuple(rings), (seconds['lhs'], seconds['rhs'])


def _estimate(eq: Equation, plan: AxisPlan, shapes, specs, dtype, mesh, hardware,
              form: _Priced) -> cost_model.Estimate:
  """The cost model's estimate for a ring over ``plan.axis``, operands as a device holds
  them in that ring."""
  return cost_model.estimate(eq, plan, *shapes, dtype, mesh, hardware,
                             wire_fp32=form.wire_fp32,
                             local=local_elements(eq, plan.axis, *shapes, specs, mesh),
                             flops=device_flops(eq, plan.axis, *shapes, specs, mesh),
                             apart_pairs=form.apart_pairs)


def _choose_axis(eq, candidates, shapes, specs, dtype, mesh, hardware,
                 form: _Priced) -> AxisPlan:
  """The axis whose collective costs most; ``tensor`` when there is no model."""
  if len(candidates) == 1 or hardware is None:
    named = [p for p in candidates if p.axis == 'tensor']
    return (named or candidates)[0]
  cost = lambda p: cost_model.estimate(eq, p, *shapes, dtype, mesh, hardware,
                                       wire_fp32=form.wire_fp32).comm_seconds
  return max(candidates, key=cost)


def local_elements(eq: Equation, axis: str, lhs_shape, rhs_shape, specs, mesh):
  """Elements of (lhs, rhs, output) one device holds in the ring over ``axis``.

  Operands as the ring takes them (``hoisted_specs``: other axes' collectives done
  before it); the output without the axes its partial sums are reduced over
  after the ring, which hold it whole until then.
  """
  lhs_spec, rhs_spec, out_spec = specs
  lhs_spec, rhs_spec = hoisted_specs(eq, axis, lhs_spec, rhs_spec, out_spec)
  summed = _summed_axes(eq, axis, lhs_spec, rhs_spec)
  sizes = {**dict(zip(eq.lhs, lhs_shape)), **dict(zip(eq.rhs, rhs_shape))}

  def count(letters, spec, whole=()):
    axes = [a for ax in einsum_plan.letter_axes(letters, spec).values() for a in ax
            if a not in whole]
    return math.prod(sizes[l] for l in letters) / math.prod(mesh.shape[a] for a in axes)

  return count(eq.lhs, lhs_spec), count(eq.rhs, rhs_spec), count(eq.out, out_spec, summed)


def device_flops(eq: Equation, axis: str, lhs_shape, rhs_shape, specs, mesh) -> float:
  """The einsum's FLOPs on one device over the whole ring over ``axis``: its FLOPs over
  the ring's size and the sizes of the other axes that shard its operands as the ring
  takes them (``hoisted_specs``); an axis that shards neither (a ``data`` axis the layer
  does not split) holds the einsum whole on each of its devices, so it divides nothing.
  """
  lhs_spec, rhs_spec = hoisted_specs(eq, axis, *specs)
  sizes = {**dict(zip(eq.lhs, lhs_shape)), **dict(zip(eq.rhs, rhs_shape))}
  axes = {a for letters, spec in ((eq.lhs, lhs_spec), (eq.rhs, rhs_spec))
          for ax in einsum_plan.letter_axes(letters, spec).values() for a in ax} - {axis}
  return 2 * math.prod(sizes.values()) / mesh.shape[axis] / math.prod(
      mesh.shape[a] for a in axes)


def _problem(eq, p, shapes, specs, mesh, alone: bool = True) -> str:
  """Why this axis cannot be decomposed, or ''.

  ``alone``: the axis must shard each of its dims alone (the forward's rule); else
  other axes of size 1 on its dims are ignored (a weight gradient's ring over
  ``fsdp`` where the batch is over ``(data, fsdp)`` and ``data`` is 1). Either way a
  reduce-scatter's contracted dim may be sharded over other axes too where both
  operands shard it alike (the batch over ``(data, fsdp)`` in a weight gradient): each
  device contracts its own block, and the partial sums over the other axes are reduced
  after the ring (``_summed_axes``).
  """
  if p.kind not in DECOMPOSABLE:
    return p.reason
  n = mesh.shape[p.axis]
  sizes = {**dict(zip(eq.lhs, shapes[0])), **dict(zip(eq.rhs, shapes[1]))}
  out_axes = einsum_plan.letter_axes(eq.out, specs[2]).values()
  if p.kind != 'reducescatter' and not any(p.axis in axes for axes in out_axes):
    return f'the output is replicated over {p.axis}: each device would compute all of it'
  alike = set()
  if p.kind == 'reducescatter':
    lhs_axes, rhs_axes = (einsum_plan.letter_axes(l, s)[p.letter]
                          for l, s in ((eq.lhs, specs[0]), (eq.rhs, specs[1])))
    alike = {p.letter} if lhs_axes == rhs_axes else set()
  for letters, spec in zip((eq.lhs, eq.rhs, eq.out), specs):
    for letter, axes in einsum_plan.letter_axes(letters, spec).items():
      shared = [a for a in axes if a != p.axis and (alone or mesh.shape[a] > 1)]
      if p.axis in axes and shared and letter not in alike:
        return f'{p.axis} shares a dimension with other mesh axes {axes}'
  for letter in filter(None, (p.letter, p.out_letter)):
    if sizes[letter] % n:
      return f'dimension {letter}={sizes[letter]} is not divisible by {p.axis}={n}'
  return ''


def collective_einsum(equation: str, lhs: jax.Array, rhs: jax.Array, *, mesh,
                      lhs_spec, rhs_spec, out_spec, mode: str = 'auto', hardware=None,
                      ring_dtype: str = 'compute',
                      prefer: Mapping[str, Any] | None = None) -> jax.Array:
  """``einsum(equation, lhs, rhs)`` with its collective decomposed over a ring.

  Args:
    equation: e.g. ``"btd,df->btf"``.
    lhs, rhs: global arrays laid out as ``lhs_spec`` / ``rhs_spec`` (resharded
      to them if they are not).
    mesh: the device mesh; all axes Auto (an Explicit axis raises ValueError).
    lhs_spec, rhs_spec, out_spec: PartitionSpecs over ``mesh``.
    mode: ``none`` (plain einsum; the compiler inserts the collective),
      ``unidirectional``, ``bidirectional``, or ``auto`` (the cost model picks).
    hardware: a ``parallelism.hardware`` profile name for the cost model
      (default: ``cpu``, where decomposition never pays).
    ring_dtype: what partial sums travel and rest in (``RING_DTYPES``): the rings'
      accumulators (a reduce-scatter's on the wire, a contracting all-gather's between
      steps), and under ``none`` the dot's output, which the compiler's reduce-scatter
      or all-reduce carries.
    prefer: ring schedule settings to use instead of the planner's, where they apply
      (``parallelism/schedule.py``), e.g. ``{'unroll': 2}``.

  Returns:
    The result laid out as ``out_spec``; bf16 products accumulate in fp32 on
    each device (in the MXU under ``none``).
  """
  explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types)
              if t != jax.sharding.AxisType.Auto]
  if explicit:  # operands are resharded with constraints, which need Auto axes
    raise ValueError(f'collective_einsum needs a mesh whose axes are all Auto; {explicit} '
                     'are not (parallelism.mesh.make_mesh builds Auto meshes)')
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  decision = explain(equation, lhs.shape, rhs.shape, dtype, mesh=mesh, lhs_spec=lhs_spec,
                     rhs_spec=rhs_spec, out_spec=out_spec, mode=mode, hardware=hardware,
                     ring_dtype=ring_dtype, prefer=prefer)
  return run_decision(decision, lhs, rhs, mesh=mesh, lhs_spec=lhs_spec, rhs_spec=rhs_spec,
                      out_spec=out_spec)


def run_decision(decision: Decision, lhs, rhs, *, mesh, lhs_spec, rhs_spec,
                 out_spec) -> jax.Array:
  """Computes the einsum as ``decision`` (from ``explain``) says: its mode, axis, gradient
  forms, ``ring_dtype`` and each ring's schedule (``decision.schedules``).

  ``decision.ring_order`` ('lhs' or 'out'; '' none) names the operand or result whose
  blocks along the ring's dimension are in ring order on each device
  (``ring.ring_position``): where only position-wise work lies between a ring that gathers
  an activation and one that scatters it back, the tokens need not be put back in order
  between them (``ring_order_fits`` says where it may be asked).
  """
  order = decision.ring_order
  if order and not ring_order_fits(decision, lhs_spec, rhs_spec, out_spec, order):
    raise ValueError(f'{decision.equation}: ring_order={order!r} needs every einsum of it '
                     f'a ring over {decision.axis} holding the {order} whole along it')
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  put = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  lhs, rhs = put(lhs, PartitionSpec(*lhs_spec)), put(rhs, PartitionSpec(*rhs_spec))
  if not decision.decomposed:
    out = _plain(decision.equation, lhs, rhs, dtype, decision.ring_dtype == 'float32')
  else:  # a ring forward, or a plain one whose gradients ring (cfg.axis None)
    out = _decomposed(_static(decision, (lhs_spec, rhs_spec, out_spec), mesh), lhs, rhs)
  return put(out, PartitionSpec(*out_spec))


def _static(decision: Decision, specs, mesh) -> '_Static':
  """The forward ring's ``_Static`` (its gradients': ``transposed``) for ``decision``."""
  lhs_spec, rhs_spec, out_spec = (PartitionSpec(*s) for s in specs)
  return _Static(decision.equation, mesh, lhs_spec, rhs_spec, out_spec, decision.axis,
                 decision.mode == 'bidirectional', decision.ring_dtype == 'float32',
                 decision.backward, decision.backward_over, decision.schedules,
                 ring_order=decision.ring_order)


def ring_order_fits(decision: Decision, lhs_spec, rhs_spec, out_spec, array: str) -> bool:
  """Whether ``array`` ('lhs', 'rhs' or 'out') of the einsum ``decision`` runs can hold its
  blocks in ring order: the forward and both gradients are rings over the same axis, and
  each holds that array (or, in a gradient, its counterpart) whole along its ring."""
  if (decision.mode == 'none' or decision.backward != ('ring', 'ring') or
      any(o is not None and o[0] != decision.axis for o in decision.backward_over)):
    return False
  cfg = dataclasses.replace(_static(decision, (lhs_spec, rhs_spec, out_spec), None),
                            ring_order=array)
  return all(_whole_along_ring(c) == c.ring_order
             for c in (cfg, cfg.transposed('lhs'), cfg.transposed('rhs')))


def _whole_along_ring(cfg: _Static) -> str | None:
  """Which of (lhs, rhs, out) the ring of ``cfg`` holds whole along its dimension: an
  all-gather ring's result or the operand it does not gather, a reduce-scatter ring's
  sliced operand (None: not a ring)."""
  eq, plans = einsum_plan.plan(cfg.equation, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  plan = next((p for p in plans if p.axis == cfg.axis), None)
  if plan is None or plan.kind not in DECOMPOSABLE:
    return None
  if plan.kind == 'allgather_free':
    return 'out'
  if plan.kind == 'allgather_contracting':
    return 'rhs' if plan.gathered == 'lhs' else 'lhs'
  return 'lhs' if plan.out_letter in eq.lhs else 'rhs'


def _plain(equation: str, lhs, rhs, dtype, wire_fp32: bool):
  """One einsum, whose collectives the compiler inserts. The dot's output type is what the
  compiler's reduce-scatter or all-reduce of partial sums carries: the compute dtype (the
  MXU still accumulates each shard's products in fp32), as the rings do, unless
  ``ring_dtype`` says float32."""
  return jnp.einsum(equation, lhs, rhs,
                    preferred_element_type=_wire(dtype, wire_fp32)).astype(dtype)


def _acc(dtype):
  return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def _wire(dtype, fp32: bool):
  """What partial sums of a ``dtype`` einsum travel in: ``dtype`` itself, or at least
  fp32 under ``ring_dtype='float32'``."""
  return _acc(dtype) if fp32 else dtype


@dataclasses.dataclass(frozen=True)
class _Static:
  equation: str
  mesh: jax.sharding.Mesh
  lhs_spec: PartitionSpec
  rhs_spec: PartitionSpec
  out_spec: PartitionSpec
  axis: str | None  # None: the forward is one einsum, only a gradient rings
  bidirectional: bool
  wire_fp32: bool = False  # partial sums (accumulators, reductions) travel in fp32
  backward: tuple[str, str] = ('ring', 'ring')  # Decision.backward
  backward_over: tuple = (None, None)  # Decision.backward_over
  schedules: tuple = (None, None, None)  # Decision.schedules
  ring: int = 0  # which of them this einsum's ring is: 0 forward, 1 lhs gradient, 2 rhs
  activation_out: bool = True  # the output is an activation (not a weight's gradient)
  # Which of (lhs, rhs, out) holds its blocks along the ring's dimension in ring order
  # (``ring.ring_position``; '' none): the array every ring of this einsum holds whole
  # there (``ring_order_fits``)
  ring_order: str = ''

  @property
  def sched(self) -> schedule.RingSchedule:
    """This ring's schedule (the simplest where the plan has none: ``ring_order_fits``)."""
    return self.schedules[self.ring] or schedule.RingSchedule(
        'bidirectional' if self.bidirectional else 'unidirectional')

  def transposed(self, which: str) -> '_Static':
    """The einsum giving the gradient of operand ``which`` ('lhs' or 'rhs'), over the
    axis its ring runs on."""
    eq = Equation.parse(self.equation)
    axis, mode = self.backward_over[0 if which == 'lhs' else 1] or (
        self.axis, 'bidirectional' if self.bidirectional else 'unidirectional')
    if which == 'lhs':
      equation, specs = f'{eq.out},{eq.rhs}->{eq.lhs}', (self.out_spec, self.rhs_spec,
                                                           self.lhs_spec)
    else:
      equation, specs = f'{eq.lhs},{eq.out}->{eq.rhs}', (self.lhs_spec, self.out_spec,
                                                           self.rhs_spec)
    # the gradient einsum's (lhs, rhs, out) are this one's (out, rhs, lhs) or (lhs, out, rhs)
    order = ({'out': 'lhs', 'rhs': 'rhs', 'lhs': 'out'} if which == 'lhs' else
             {'lhs': 'lhs', 'out': 'rhs', 'rhs': 'out'}).get(self.ring_order, '')
    return dataclasses.replace(self, equation=equation, lhs_spec=specs[0],
                               rhs_spec=specs[1], out_spec=specs[2], axis=axis,
                               bidirectional=mode == 'bidirectional',
                               ring=1 if which == 'lhs' else 2,
                               activation_out=which == 'lhs', ring_order=order)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decomposed(cfg: _Static, lhs, rhs):
  return _forward(cfg, lhs, rhs)


def _forward(cfg: _Static, lhs, rhs):
  if cfg.axis is None:
    return _plain(cfg.equation, lhs, rhs, jnp.result_type(lhs.dtype, rhs.dtype),
                  cfg.wire_fp32)
  return _ring_einsum(cfg, lhs, rhs)


def _decomposed_fwd(cfg, lhs, rhs):
  return _forward(cfg, lhs, rhs), (lhs, rhs)


def _decomposed_bwd(cfg, residuals, g):
  lhs, rhs = residuals
  if _hands_cotangent_on(cfg):
    # The data gradient's ring gathers g over the forward's axis block by block; the
    # weight gradient's ring over another axis (fsdp) gets g whole from it instead of the
    # compiler gathering it again (the same bytes twice over the same links). Not for a
    # weight gradient as one einsum: the compiler then kept g whole longer (moe_1t's
    # attn.o and mlp.down: 31.69 GiB per chip, 29.88 with the compiler's gather).
    d_lhs, g = _transpose_einsum(cfg.transposed('lhs'), g, rhs, lhs.dtype, keep_gathered=True)
  else:
    if cfg.schedules[2] is not None and cfg.schedules[2].gather == 'before':
      lhs, g = _gathered_first(cfg, lhs, g)
    d_lhs = _transpose_einsum(cfg.transposed('lhs'), g, rhs, lhs.dtype, cfg.backward[0])
  d_rhs = _transpose_einsum(cfg.transposed('rhs'), lhs, g, rhs.dtype, cfg.backward[1])
  return d_lhs, d_rhs


def _hands_cotangent_on(cfg: _Static) -> bool:
  """Whether the data gradient's ring hands the cotangent it gathered on to the weight
  gradient's ring over another axis (``_decomposed_bwd``)."""
  eq, specs = Equation.parse(cfg.equation), (cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  return (cfg.backward == ('ring', 'ring') and cfg.backward_over[0] is None and
          cfg.backward_over[1] is not None and cfg.backward_over[1][0] != cfg.axis and
          keeps_cotangent(eq, cfg.axis, specs, cfg.mesh))


def _gather_first_spec(cfg: _Static):
  """The spec the weight gradient's ring over another axis takes ``lhs`` in, where the
  compiler gathers it over the forward's axis beside a two-way data-gradient ring (the
  schedule's ``gather`` applies there: ``_gathered_first``); else None."""
  if cfg.backward != ('ring', 'ring') or _hands_cotangent_on(cfg):
    return None
  w, d = cfg.transposed('rhs'), cfg.transposed('lhs')
  if w.axis in (None, cfg.axis) or not d.bidirectional:
    return None
  spec, _ = hoisted_specs(Equation.parse(w.equation), w.axis, w.lhs_spec, w.rhs_spec,
                          w.out_spec)
  over_axis = lambda s: cfg.axis in {a for e in s for a in einsum_plan.axes_of(e)}
  return spec if over_axis(cfg.lhs_spec) and not over_axis(spec) else None


def _gathered_first(cfg: _Static, lhs, g):
  """``lhs`` as the weight gradient's ring over another axis takes it, gathered over the
  forward's axis by the compiler, and ``g`` held back until it is (``ring.waiting_for``):
  where the data gradient's ring over the forward's axis is bidirectional, its transfers
  fill both directions of the links that gather runs on, and beside it one queued behind
  the other (dense_500b's ``attn.qkv``: 0.060 s a step exposed, 0.020 s with the gather
  first; modeled, docs/paper_scale.md). Else both as they were."""
  spec = _gather_first_spec(cfg)
  if spec is not None:  # the compiler gathers it
    lhs = jax.lax.with_sharding_constraint(lhs, NamedSharding(cfg.mesh, spec))
    g = ring.waiting_for(g, lhs)
  return lhs, g


def keeps_cotangent(eq: Equation, axis: str, specs, mesh) -> bool:
  """Whether the data gradient's ring over ``axis`` gathers the cotangent (an
  all-gather ring, the transpose of a reduce-scatter one: ``attn.o``, ``mlp.down``) with
  no partial sums over other axes, so that it can hand the cotangent on whole."""
  lhs_spec, rhs_spec, out_spec = specs
  d_eq, plans = einsum_plan.plan(f'{eq.out},{eq.rhs}->{eq.lhs}', out_spec, rhs_spec, lhs_spec)
  plan = next((p for p in plans if p.axis == axis), None)
  if plan is None or plan.kind != 'allgather_free' or plan.gathered != 'lhs':
    return False
  hoisted = hoisted_specs(d_eq, axis, out_spec, rhs_spec, lhs_spec)
  return not [a for a in _summed_axes(d_eq, axis, *hoisted) if mesh.shape[a] > 1]


_decomposed.defvjp(_decomposed_fwd, _decomposed_bwd)


def _axis_plan(cfg: _Static) -> tuple[Equation, AxisPlan]:
  eq, plans = einsum_plan.plan(cfg.equation, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  return eq, next(p for p in plans if p.axis == cfg.axis)


def _transpose_einsum(cfg: _Static, a, b, dtype, form: str = 'ring',
                      keep_gathered: bool = False):
  """A gradient einsum, decomposed over the same axis when its pattern allows and
  ``form`` is 'ring'; else one einsum over what the compiler gathers. With
  ``keep_gathered`` (a ring), also the operand the ring gathered (``_ring_einsum``)."""
  whole = None
  if form == 'ring' and cfg.axis and _axis_plan(cfg)[1].kind in DECOMPOSABLE:
    out = _ring_einsum(cfg, a, b, keep_gathered)
    if keep_gathered:
      out, whole = out
  else:  # e.g. an all-reduce: the compiler's collective, of partial sums in the wire dtype
    out = jnp.einsum(cfg.equation, a, b, preferred_element_type=_wire(dtype, cfg.wire_fp32))
  out = jax.lax.with_sharding_constraint(out, NamedSharding(cfg.mesh, cfg.out_spec))
  return (out.astype(dtype), whole) if keep_gathered else out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """What each device's ring body needs, fixed when the einsum is traced."""
  eq: Equation
  plan: AxisPlan          # the decomposed axis and its collective
  n: int                  # devices on the ring
  split: tuple[int, int]  # ring.ring_split: contributions arriving from each direction
  unroll: int | bool      # ring steps per loop iteration (True: all of them)
  dtype: Any              # the einsum's result dtype
  wire: Any               # what partial sums travel and rest in between ring steps
  manual: tuple[str, ...]  # the shard_map's manual axes: the ring's, then ``summed``
  summed: tuple[str, ...]  # axes whose partial sums are reduced after the ring
  scatter: dict           # output dim -> the summed axes it is reduce-scattered over
  reduce_dtype: Any       # what the reduction over ``summed`` carries
  keep: bool = False      # an all-gather ring also returns the operand it gathered, whole
  contiguous: bool = False  # contiguous_blocks on the operands the rings slice
  last_apart: bool = False  # a reduce-scatter ring's own contribution kept out of the fusions
  row_major: bool = False  # a reduce-scatter ring's accumulators in the default layout
  # its schedule's additions 'fused': a reduce-scatter ring's additions in its einsums, its
  # accumulators in halves (``schedule._additions_for`` says which rings: a bidirectional
  # weight gradient's einsums, one a direction, would read the activation each round twice:
  # HBM-bound, dense_500b +0.84 s a step)
  fused_additions: bool = False
  # its schedule's additions 'kernel': an even bidirectional weight-gradient ring runs each
  # round as one Pallas kernel for both directions (``_pair_kernel_ring``): 'mosaic'
  # (compiled for a TPU), 'interpret' (Pallas's interpreter elsewhere), or ''
  pair_kernel: str = ''
  # its schedule's pairs 'apart': a bidirectional all-gather ring without partial sums runs
  # an einsum a block, each product written where it goes, not one einsum over the pair
  apart_pairs: bool = False
  # the array the ring holds whole along its dimension has its blocks in ring order
  # (``ring.ring_position``; ``_Static.ring_order``)
  ring_order: bool = False


def _ring_einsum(cfg: _Static, lhs, rhs, keep_gathered: bool = False):
  """Runs the decomposed einsum in a shard_map manual over ``cfg.axis`` (and summed axes).

  With ``keep_gathered`` (an all-gather ring without partial sums, ``keeps_cotangent``),
  returns the result and the operand the ring gathered, whole over ``cfg.axis``: the
  blocks that passed.
  """
  named, before = cfg.equation, Equation.parse(cfg.equation)
  cfg, lhs, rhs = _gathered_dims_major(cfg, lhs, rhs)
  eq, plan = _axis_plan(cfg)
  n = cfg.mesh.shape[cfg.axis]
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  # XLA's in-process CPU collectives can fail when one collective-permute runs
  # again right away, as in a loop: a device that is fast re-enters the
  # rendezvous of the previous step before the slow ones have left it ("Check
  # failed: state.use_count() == num_threads (9 vs. 8)", seen with 8 fake
  # devices). On CPU the ring is therefore fully unrolled, so every step has
  # its own ops; other backends keep the loop and ``unroll``.
  on_cpu = cfg.mesh.devices.flat[0].platform == 'cpu'
  sched = cfg.sched
  unroll = True if on_cpu else sched.unroll
  direction = 'bidirectional' if cfg.bidirectional else 'unidirectional'
  # Collectives over other axes (an FSDP weight's gather) happen once, here,
  # not once per ring step inside the loop, where the compiler would put them.
  lhs_spec, rhs_spec = hoisted_specs(eq, cfg.axis, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  lhs = jax.lax.with_sharding_constraint(lhs, NamedSharding(cfg.mesh, lhs_spec))
  rhs = jax.lax.with_sharding_constraint(rhs, NamedSharding(cfg.mesh, rhs_spec))
  extra = _manual_extra(cfg, eq, lhs_spec, rhs_spec)
  summed = extra[:len(_summed(cfg, eq, lhs_spec, rhs_spec))]
  manual = (cfg.axis,) + extra
  # A Mosaic kernel runs only where every mesh axis is manual: a pair-kernel ring has every
  # axis of size > 1 manual already (the planner checked: ``_kernel_problem``) and makes the
  # others (of size 1) manual too.
  kernel = sched.additions == 'kernel'
  if kernel:
    manual += tuple(a for a in cfg.mesh.axis_names if a not in manual)
  keep = lambda spec: PartitionSpec(*[
      einsum_plan.spec_entry(tuple(a for a in einsum_plan.axes_of(e) if a in manual))
      for e in spec])
  scatter, out_spec = _reduction(eq, summed, cfg.out_spec, manual)
  # Partial sums over ``summed`` cross devices in the wire dtype, as the compiler's
  # reductions of plain einsums do: bf16 halves a weight gradient's reduce-scatter. XLA's
  # CPU backend aborts on a bf16 psum here ("Invalid binary instruction opcode copy"), so
  # on CPU they are reduced in fp32.
  r = _Ring(eq, plan, n, ring.ring_split(n, cfg.bidirectional), unroll, dtype,
            _wire(dtype, cfg.wire_fp32), manual, summed, scatter,
            _wire(dtype, cfg.wire_fp32 or on_cpu), keep_gathered, sched.layout == 'contiguous',
            sched.last == 'apart', sched.layout == 'contiguous' and cfg.activation_out,
            sched.additions == 'fused',
            ('' if not kernel else
             'mosaic' if cfg.mesh.devices.flat[0].platform == 'tpu' else 'interpret'),
            sched.pairs == 'apart', bool(cfg.ring_order))  # run_decision checked it fits
  if keep_gathered:
    if summed or plan.kind == 'reducescatter':
      raise ValueError(f'{named}: only an all-gather ring without partial sums over other '
                       f'axes keeps what it gathered (summed over {summed}, {plan.kind})')
    gathered = lhs_spec if plan.gathered == 'lhs' else rhs_spec
    out_spec = (out_spec, PartitionSpec(*[einsum_plan.spec_entry(tuple(
        a for a in einsum_plan.axes_of(e) if a in manual and a != cfg.axis)) for e in gathered]))
  # The scope names our ops in HLO metadata, so schedules can be checked.
  with jax.named_scope(f'{SCOPE}/{plan.kind}/{direction}/{named}'):
    out = jax.shard_map(functools.partial(_local, r), mesh=cfg.mesh,
                        in_specs=(PartitionSpec(cfg.axis), keep(lhs_spec), keep(rhs_spec)),
                        out_specs=out_spec, axis_names=set(manual),
                        # every device of the ring holds the same whole operand, which the
                        # type check cannot see in blocks written one ring step at a time;
                        # nor can it follow a kernel's varying block indices (Pallas's
                        # interpreter) or outputs (Mosaic's, over the size-1 axes made manual)
                        check_vma=not keep_gathered and not r.pair_kernel)(
                            ring.ring_positions(n), lhs, rhs)
  if not keep_gathered:
    return out
  old, new = ((before.lhs, eq.lhs) if plan.gathered == 'lhs' else (before.rhs, eq.rhs))
  return out[0], jnp.transpose(out[1], [new.index(l) for l in old])


def _summed(cfg: _Static, eq: Equation, lhs_spec, rhs_spec) -> tuple[str, ...]:
  """Axes that shard a contracted dim of both operands (a weight gradient's batch): manual
  too, so partial sums accumulate over the ring and are reduced once after it, not once
  per step."""
  return tuple(a for a in _summed_axes(eq, cfg.axis, lhs_spec, rhs_spec)
               if cfg.mesh.shape[a] > 1)


def _manual_extra(cfg: _Static, eq: Equation, lhs_spec, rhs_spec) -> tuple[str, ...]:
  """The ring's shard_map's manual axes besides its own: ``_summed``'s, then axes that shard
  the einsum alike everywhere (an expert weight gradient's experts), where each device keeps
  its block. Left to the compiler inside the shard_map, it gathered them around the
  reduction over the summed axes (a v5p MoE program: every expert's gradient all-gathered
  and reduce-scattered, 16x the bytes)."""
  summed = _summed(cfg, eq, lhs_spec, rhs_spec)
  passing = tuple(a for a in _passing_axes(eq, cfg.axis, lhs_spec, rhs_spec, cfg.out_spec)
                  if a not in summed and cfg.mesh.shape[a] > 1)
  return summed + passing


def _gathered_dims_major(cfg: _Static, lhs, rhs):
  """(cfg, lhs, rhs) with each operand that is gathered before the ring along its last
  (minor) dimension (an FSDP weight's ``embed``, as in ``mlp.down``'s [mlp, embed] and
  ``attn.o``'s [heads, head_dim, embed]) transposed so that dimension comes first, the
  equation's letters with it.

  Gathered along its minor dimension, the TPU compiler's all-gather wrote the weight
  transposed in memory and the ring's loop then copied it to the other layout
  (dense_500b: 335 MB a layer and pass; ours 8.239 -> 8.173 s a step, modeled); transposed
  first, the transpose is the local shard's, before the gather, and the gathered blocks are
  contiguous. (Moving the dimension a weight gradient's ring slices made no difference:
  the compiler transposes its operand whole either way.) ``lhs`` and ``rhs`` may be
  shapes (tuples), moved the same way (the planner's ``_ring_facts``).
  """
  eq = Equation.parse(cfg.equation)
  hoisted = hoisted_specs(eq, cfg.axis, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  letters, specs, ops = [eq.lhs, eq.rhs], [cfg.lhs_spec, cfg.rhs_spec], [lhs, rhs]
  for i, kept in enumerate(hoisted):
    axes, last = einsum_plan.letter_axes(letters[i], specs[i]), letters[i][-1]
    if len(letters[i]) > 1 and axes[last] != einsum_plan.letter_axes(letters[i], kept)[last]:
      letters[i] = last + letters[i][:-1]
      specs[i] = PartitionSpec(*map(einsum_plan.spec_entry, (axes[l] for l in letters[i])))
      ops[i] = ((ops[i][-1],) + ops[i][:-1] if isinstance(ops[i], tuple)
                else jnp.moveaxis(ops[i], -1, 0))
  if letters == [eq.lhs, eq.rhs]:
    return cfg, lhs, rhs
  return (dataclasses.replace(cfg, equation=f'{letters[0]},{letters[1]}->{eq.out}',
                              lhs_spec=specs[0], rhs_spec=specs[1]), *ops)


def _summed_axes(eq: Equation, axis: str, lhs_spec, rhs_spec) -> tuple[str, ...]:
  """Mesh axes (not ``axis``) sharding one contracted letter in both operands."""
  lhs = einsum_plan.letter_axes(eq.lhs, lhs_spec)
  rhs = einsum_plan.letter_axes(eq.rhs, rhs_spec)
  out = []
  for letter in eq.lhs:
    if letter in eq.rhs and letter not in eq.out and lhs[letter] == rhs[letter]:
      out += [a for a in lhs[letter] if a != axis and a not in out]
  return tuple(out)


def _passing_axes(eq: Equation, axis: str, lhs_spec, rhs_spec, out_spec) -> tuple[str, ...]:
  """Mesh axes (not ``axis``) that shard every letter they touch alike in all three
  arrays (``einsum_plan``'s ``pass``): no collective, each device computes its block."""
  maps = [einsum_plan.letter_axes(l, s) for l, s in ((eq.lhs, lhs_spec), (eq.rhs, rhs_spec),
                                                     (eq.out, out_spec))]
  axes = sorted({a for m in maps for entry in m.values() for a in entry} - {axis})
  return tuple(a for a in axes if einsum_plan.classify_axis(eq, a, *maps).kind == 'pass')


def _reduction(eq: Equation, summed, out_spec, manual):
  """(dims to psum_scatter {dim: axes}, the shard_map's out spec) for the summed axes.

  An output dim sharded over summed axes only gets a reduce-scatter over them;
  the remaining summed axes get an all-reduce.
  """
  out = einsum_plan.letter_axes(eq.out, out_spec)
  scatter = {}
  for dim, letter in enumerate(eq.out):
    axes = out[letter]
    if axes and all(a in summed for a in axes):
      scatter[dim] = axes
  spec = []
  for dim, letter in enumerate(eq.out):
    kept = scatter.get(dim) or tuple(a for a in out[letter] if a in manual and a not in summed)
    spec.append(einsum_plan.spec_entry(kept))
  return scatter, PartitionSpec(*spec)


def hoisted_specs(eq: Equation, axis: str, lhs_spec, rhs_spec, out_spec):
  """Operand specs for the ring: other mesh axes kept only where no collective needs them.

  An operand dimension keeps a mesh axis other than the ring's ``axis`` when
  the output shards that letter over it too, or when the letter is contracted
  and the other operand shards it the same way (partial sums, reduced after).
  Any other use (an FSDP weight's ``embed`` over ``fsdp`` against unsharded
  activations) is dropped, so the operand is gathered once before the ring.
  """
  out = einsum_plan.letter_axes(eq.out, out_spec)
  sides = ((eq.lhs, einsum_plan.letter_axes(eq.lhs, lhs_spec), eq.rhs, rhs_spec),
           (eq.rhs, einsum_plan.letter_axes(eq.rhs, rhs_spec), eq.lhs, lhs_spec))
  specs = []
  for letters, axes, other_letters, other_spec in sides:
    other = einsum_plan.letter_axes(other_letters, other_spec)
    keep = lambda l, a: (a == axis or a in out.get(l, ()) or
                         (l not in eq.out and a in other.get(l, ())))
    entries = [tuple(a for a in axes[l] if keep(l, a)) for l in letters]
    specs.append(PartitionSpec(*map(einsum_plan.spec_entry, entries)))
  return tuple(specs)


def _local(r: _Ring, ids, lhs, rhs):
  """Per-device body: blocks along the manual axes are local, other axes global.

  The result holds partial sums over ``r.summed`` until the end, where each dim
  in ``r.scatter`` is reduce-scattered over its axes and the rest all-reduced,
  in ``r.reduce_dtype``.
  """
  if r.plan.kind == 'reducescatter':
    out = _reduce_scatter_local(r, ids[0], lhs, rhs)
  else:
    out = _all_gather_local(r, ids[0], lhs, rhs)
  if not r.summed:
    return out
  out = out.astype(r.reduce_dtype)
  scattered = set()
  for dim, axes in r.scatter.items():
    out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
    scattered.update(axes)
  rest = tuple(a for a in r.summed if a not in scattered)
  return (jax.lax.psum(out, rest) if rest else out).astype(r.dtype)


def _reduce_scatter_local(r: _Ring, idx, lhs, rhs):
  """The reduce-scatter ring on local blocks; accumulators travel as ``r.wire``."""
  eq, z = r.eq, r.plan.out_letter  # the scattered output dim, whole in its operand
  on_lhs = z in eq.lhs
  owner = lhs if on_lhs else rhs
  dim = (eq.lhs if on_lhs else eq.rhs).index(z)
  block = owner.shape[dim] // r.n
  if r.contiguous:
    owner = contiguous_blocks(owner, dim)

  # Partial sums leave the MXU (fp32 inside) in the wire dtype, travel and wait in it.
  wire = r.wire

  other, other_letters = (rhs, eq.rhs) if on_lhs else (lhs, eq.lhs)
  if r.pair_kernel:  # the planner checked that it fits (``_kernel_problem``)
    return _pair_kernel_ring(r, idx, owner, other,
                             *_kernel_form(eq, z, owner.shape, other.shape)).astype(r.dtype)
  at = lambda k: ring.ring_position(k, idx, r.n, r.ring_order)  # where block k sits
  halved = _halved_letter(eq, z, other_letters, other.shape) if r.fused_additions else None

  def partial(*ks, after=None, half=None):  # one einsum for the output blocks ks, joined along z
    piece = jnp.concatenate([jax.lax.dynamic_slice_in_dim(owner, at(k) * block, block, dim)
                             for k in ks], axis=dim)
    # The wait is on the operand that is not sliced (a weight, already whole): on the
    # sliced one, whatever produces it would be written out whole first (64B: the
    # SwiGLU's gradient, joined from gate's and up's, a pass of its own). Halved after
    # it, the halves are read where the einsum reads them, not copied out of the loop.
    operand = other if after is None else ring.waiting_for(other, after)
    if half is not None:
      operand = jnp.split(operand, 2, other_letters.index(halved))[half]
    args = (piece, operand) if on_lhs else (operand, piece)
    return jnp.einsum(str(eq), *args,
                      preferred_element_type=wire if half is None else jnp.float32)

  laid_out = default_layout if r.row_major else lambda x: x
  out = ring.reduce_scatter_einsum(partial, axis=r.plan.axis, n=r.n, idx=idx, split=r.split,
                                   unroll=r.unroll, pair_axis=eq.out.index(z),
                                   last_apart=r.last_apart, laid_out=laid_out,
                                   halves_axis=None if halved is None
                                   else eq.out.index(halved))
  return out.astype(r.dtype)


def _kernel_form(eq: Equation, z: str, owner_shape, other_shape):
  """How ``pair_sums`` runs a weight gradient's reduce-scatter ring, or None: the sliced
  operand's letters are the contracted ones then ``z`` (minor), the other's the same
  contracted ones then the output's others. Returns (B, T, D, P, Q, the output's letters
  in the kernel's order [P..., z, Q], the accumulators' halved dimension: Q's, or P's
  where Q's halves are not whole lane tiles).
  """
  owner, other = (eq.lhs, eq.rhs) if z in eq.lhs else (eq.rhs, eq.lhs)
  contracted, cols = owner[:-1], other[len(owner) - 1:]
  if (not contracted or not cols or owner[-1] != z or not other.startswith(contracted)
      or sorted(eq.out) != sorted(z + cols)):
    return None
  p, q = math.prod(other_shape[len(contracted):-1]), other_shape[-1]
  halved = 2 if q % 256 == 0 else 0 if p % 2 == 0 else None
  if halved is None:
    return None
  b = math.prod(owner_shape[:-2])
  return b, owner_shape[-2], owner_shape[-1], p, q, cols[:-1] + z + cols[-1], halved


def _pair_kernel_ring(r: _Ring, idx, owner, other, b, t, d, p, q, letters, halved):
  """A weight gradient's even bidirectional reduce-scatter ring whose rounds each run
  ``pair_sums.pair_sums`` (both directions' contributions from one read of ``other``, each
  added to its arriving accumulator half as it is written), in the kernel's shapes: the
  accumulators ``[P, rows, Q]`` travel in halves along ``halved`` (``ring._in_halves``).
  """
  rows, c = d // r.n, owner.ndim - 1  # c: the contracted letters' count
  xt = jnp.swapaxes(owner.reshape(b, t, d), 1, 2)  # [B, D, T]: owner's laid-out order
  order = list(range(c, other.ndim - 1)) + list(range(c)) + [other.ndim - 1]
  y = jnp.transpose(other, order).reshape(p, b, t, q)  # [P, B, T, Q]
  at = lambda k: ring.ring_position(k, idx, r.n, r.ring_order)

  def operand(after):
    return y if after is None else ring.waiting_for(y, after)

  def partial(k, after=None, half=None):
    ys = operand(after)
    ys = ys if half is None else jnp.split(ys, 2, 0 if halved == 0 else 3)[half]
    x = jax.lax.dynamic_slice_in_dim(xt, at(k) * rows, rows, 1)
    return jnp.einsum('bdt,pbtq->pdq', x, ys, preferred_element_type=(
        r.wire if half is None else jnp.float32))

  def pair(k1, k2, *, half, accs, after):
    return pair_sums.pair_sums(xt, operand(after), *accs, at(k1), at(k2), half=half,
                               interpret=r.pair_kernel == 'interpret')

  out = ring.reduce_scatter_einsum(partial, axis=r.plan.axis, n=r.n, idx=idx, split=r.split,
                                   unroll=r.unroll, last_apart=r.last_apart,
                                   halves_axis=halved, pair_sums=pair)
  sizes = dict(zip(letters, other.shape[c:-1] + (rows, q)))
  out = out.reshape([sizes[l] for l in letters])
  return jnp.transpose(out, [letters.index(l) for l in r.eq.out])


def _halved_letter(eq: Equation, z: str, letters: str, shape) -> str | None:
  """The output dimension along which a reduce-scatter ring's accumulator travels in
  halves (``ring._in_halves``): the largest of even size that the operand the ring
  does not slice carries (so each half's einsum reads half of it), or None."""
  even = [l for l in letters if l in eq.out and l != z and shape[letters.index(l)] % 2 == 0]
  return max(even, key=lambda l: shape[letters.index(l)], default=None)


def _all_gather_local(r: _Ring, idx, lhs, rhs):
  """The all-gather ring on local blocks: every device's block of the gathered
  operand passes by and is consumed against the local other operand."""
  eq, plan, n, dtype, acc_dtype = r.eq, r.plan, r.n, r.dtype, _acc(r.dtype)
  g, o, g_letters, o_letters = ((lhs, rhs, eq.lhs, eq.rhs) if plan.gathered == 'lhs'
                                else (rhs, lhs, eq.rhs, eq.lhs))
  local_eq = f'{g_letters},{o_letters}->{eq.out}'
  x = plan.letter
  m = g.shape[g_letters.index(x)]
  at = lambda k: ring.ring_position(k, idx, n, r.ring_order) * m  # where block k goes
  if plan.kind == 'allgather_free':
    out_dim = eq.out.index(x)
    # Unidirectional with no loop: the parts are joined once (ring.all_gather_apart). A
    # bidirectional ring's pairs, joined so too, had their inputs copied instead (64B:
    # 4.342 -> 4.345 s, modeled); a loop needs the buffer.
    if not r.keep and not r.split[1] and (r.unroll is True or r.unroll >= n - 1):
      return ring.all_gather_apart(g, lambda block: jnp.einsum(
          local_eq, block, o, preferred_element_type=acc_dtype).astype(dtype),
          axis=plan.axis, n=n, idx=idx, dim=out_dim, ring_order=r.ring_order)
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(local_eq, a, b), g, o).shape
    out_shape = out_shape[:out_dim] + (m * n,) + out_shape[out_dim + 1:]
    # Every block is written before it is read: no zero-fill
    acc = jax.lax.pcast(ring.fresh_buffer(out_shape, dtype, after=g), r.manual,
                        to='varying')

    def consume_pair(acc, a, src_a, b, src_b):  # one einsum for both blocks
      both = jnp.einsum(local_eq, jnp.concatenate([a, b], g_letters.index(x)), o,
                        preferred_element_type=acc_dtype).astype(dtype)
      part_a, part_b = jnp.split(both, 2, axis=out_dim)
      acc = jax.lax.dynamic_update_slice_in_dim(acc, part_a, at(src_a), out_dim)
      return jax.lax.dynamic_update_slice_in_dim(acc, part_b, at(src_b), out_dim)

    def consume(acc, block, src):
      part = jnp.einsum(local_eq, block, o, preferred_element_type=acc_dtype)
      return jax.lax.dynamic_update_slice_in_dim(acc, part.astype(dtype), at(src), out_dim)

    if r.apart_pairs:  # ring.all_gather_einsum then consumes each block of a pair alone
      consume_pair = None
  else:  # allgather_contracting: o holds the whole contracting dim
    # Partial sums rest between steps in the wire dtype, as a reduce-scatter ring's do
    # (bf16 for a bf16 model: half an fp32 accumulator's memory and HBM traffic); each
    # step's product leaves the MXU in it and is added in fp32, rounded once.
    wire, o_dim = r.wire, o_letters.index(x)
    out_shape = jax.eval_shape(
        lambda a, b: jnp.einsum(local_eq, a, jax.lax.dynamic_slice_in_dim(b, 0, m, o_dim)),
        g, o).shape
    acc = jax.lax.pcast(jnp.zeros(out_shape, wire), r.manual, to='varying')

    def consume_pair(acc, a, src_a, b, src_b):  # both blocks contracted in one einsum
      pieces = [jax.lax.dynamic_slice_in_dim(o, at(s), m, o_dim) for s in (src_a, src_b)]
      return ring.sum_rounded(acc, jnp.einsum(
          local_eq, jnp.concatenate([a, b], g_letters.index(x)),
          jnp.concatenate(pieces, o_dim), preferred_element_type=wire))

    def consume(acc, block, src):
      piece = jax.lax.dynamic_slice_in_dim(o, at(src), m, o_dim)
      return ring.sum_rounded(acc, jnp.einsum(local_eq, block, piece,
                                              preferred_element_type=wire))

  if r.keep:  # every block that passes is also written into the whole operand
    consume, consume_pair = _keeping(consume, consume_pair, g_letters.index(x), m,
                                     r.contiguous)
    acc = (acc, jax.lax.pcast(ring.fresh_buffer(_times(g.shape, g_letters.index(x), n),
                                                g.dtype, after=g), r.manual, to='varying'))
  out = ring.all_gather_einsum(g, consume, acc, axis=plan.axis, n=n, idx=idx, split=r.split,
                               unroll=r.unroll, consume_pair=consume_pair)
  return (out[0].astype(dtype), out[1]) if r.keep else out.astype(dtype)


def _times(shape, dim, n):
  return shape[:dim] + (shape[dim] * n,) + shape[dim + 1:]


def contiguous_blocks(x: jax.Array, dim: int) -> jax.Array:
  """``x`` laid out so that its blocks along ``dim`` are contiguous, where ``dim`` is
  the minor dimension: it goes second-minor, the one before it minor.

  A weight-gradient ring over fsdp slices its activation operand along the model
  dimension, the minor one; left to itself, the compiler copies the whole operand into
  such a layout once a layer (dense_500b: 0.11 s a step; docs/paper_scale.md).
  """
  if x.ndim < 2 or dim != x.ndim - 1:
    return x
  order = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
  return layout.with_layout_constraint(x, layout.Layout(major_to_minor=order))


def default_layout(x: jax.Array) -> jax.Array:
  """``x`` in the default layout, its last dimension minor, as an einsum writes it.

  Under a ``contiguous`` schedule layout a reduce-scatter ring's accumulators of an
  activation ([b, t, d]) are pinned so: the compiler had laid them out as the weight
  gradient's operand of that shape is pinned (``contiguous_blocks``: d before t) and copied
  every step's product into that layout (dense_500b: 0.021 s a step of copies, 0.009 s off
  the step without them; modeled, docs/paper_scale.md).
  """
  return layout.with_layout_constraint(x, layout.Layout(major_to_minor=tuple(range(x.ndim))))


def _keeping(consume, consume_pair, dim, m, contiguous: bool = False):
  """``consume`` and ``consume_pair`` over (acc, whole): each block also written into
  ``whole`` at its source's offset along ``dim``; a ``consume_pair`` of None stays None
  (``ring.all_gather_einsum`` then keeps each block of a pair alone). With
  ``contiguous``, ``whole`` (the cotangent a weight-gradient ring over another axis slices
  next, along its last dimension) is laid out for that ring's blocks
  (``contiguous_blocks``)."""
  lay = (lambda w: contiguous_blocks(w, w.ndim - 1)) if contiguous else (lambda w: w)
  put = lambda whole, block, src: lay(
      jax.lax.dynamic_update_slice_in_dim(whole, block, src * m, dim))

  def keep_one(carry, block, src):
    acc, whole = carry
    return consume(acc, block, src), put(whole, block, src)

  def keep_pair(carry, a, src_a, b, src_b):
    acc, whole = carry
    return consume_pair(acc, a, src_a, b, src_b), put(put(whole, a, src_a), b, src_b)

  return keep_one, None if consume_pair is None else keep_pair
