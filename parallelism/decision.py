"""How one dense einsum runs, decided before it is traced: the ``Decision`` and ``explain``.

``explain(equation, lhs_shape, rhs_shape, dtype, mesh=..., lhs_spec=..., rhs_spec=...,
out_spec=...)`` picks the mesh axis whose collective the einsum's layout implies, whether
its forward and each gradient run as a ring over it (or over another axis) or as one einsum
(the cost model's prices, ``parallelism/cost_model.py``, under ``mode='auto'``), and each
ring's schedule (``parallelism/schedule.py``), with the reasons. The ``Decision`` it returns
is all that ``collective_einsum.run_decision`` needs: this module decides and runs nothing,
parallelism/collective_einsum.py runs and decides nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import jax.numpy as jnp

from parallelism import cost_model, einsum_plan, pair_sums, schedule
from parallelism import hardware as hw
from parallelism.einsum_plan import AxisPlan, Equation
from parallelism.ring_specs import (
    Static, axis_plan, gather_first_spec, gathered_dims_major, halved_letter, hoisted_specs,
    kernel_form, manual_extra, static, summed_axes)

MODES = ('none', 'unidirectional', 'bidirectional', 'always', 'auto')
# What a ring's partial sums travel and rest in: the compute dtype (bf16 for a bf16
# model: half the bytes; each device still adds in fp32) or float32.
RING_DTYPES = ('compute', 'float32')
# Which layers' gradients auto may ring (``explain``): only those whose forward rings, or
# also those whose forward is left to the compiler (``_gradients_alone``).
GRADIENT_RINGS = ('ringed_forward', 'any_forward')
# The mode of a weight gradient's ring over the forward's axis (``_backward_forms``).
WEIGHT_GRADIENT_MODE = 'bidirectional'
DECOMPOSABLE = ('allgather_free', 'allgather_contracting', 'reducescatter')
# What of a decision (and of its rings' schedules, and of an MoE exchange's) explains it
# rather than makes its program: the cost model's figures, the reasons, measured times.
# Two decisions that differ only there compile the same (``Decision.program``).
EXPLAINING = ('estimate', 'reason', 'gradient_seconds', 'measured', 'seconds',
              'why_no_kernel')


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

  def program(self) -> tuple:
    """What of the decision its compiled program depends on: every field but
    ``EXPLAINING``'s, each schedule's too."""
    made = lambda x: tuple((f.name, getattr(x, f.name)) for f in dataclasses.fields(x)
                           if f.name not in EXPLAINING)
    return tuple((k, tuple(s and made(s) for s in v) if k == 'schedules' else v)
                 for k, v in made(self))

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
            mode='auto', hardware=None, ring_dtype='compute', gradient_rings='ringed_forward',
            prefer: Mapping[str, Any] | None = None) -> Decision:
  """Decides how ``collective_einsum`` would run, without running it: the mode, the axis,
  the gradients' forms and each ring's schedule (``parallelism/schedule.py``; ``prefer``:
  schedule settings to use instead of the planner's, where they apply, as a plan file or
  a test sets them; its ``accumulators``, ``schedule.ACCUMULATORS``, 'any' unless set).

  Raises:
    ValueError: for an explicit mode that cannot be honoured, naming the specs, or a bad
      ``prefer``.
  """
  prefer = schedule.check_prefer(prefer)
  accumulators = prefer.get('accumulators', 'any')
  pairs = prefer.get('pairs')
  if mode == 'always' and 'direction' in prefer:
    mode = prefer['direction']
  overlapped = (hardware if isinstance(hardware, hw.HardwareProfile) else hw.get_profile(
      hardware or cost_model.DEFAULT_HARDWARE)).async_collectives
  decision = _decide(equation, lhs_shape, rhs_shape, dtype, mesh, (lhs_spec, rhs_spec, out_spec),
                     mode, hardware, ring_dtype, accumulators, gradient_rings,
                     pairs or ('apart' if overlapped else 'joined'), overlapped)
  return with_schedules(decision, lhs_shape, rhs_shape, mesh=mesh, lhs_spec=lhs_spec,
                        rhs_spec=rhs_spec, out_spec=out_spec, hardware=hardware, prefer=prefer,
                        dtype=dtype)


def _decide(equation, lhs_shape, rhs_shape, dtype, mesh, all_specs, mode, hardware, ring_dtype,
            accumulators, gradient_rings, gather_pairs, overlapped) -> Decision:
  """``explain``'s mode, axis and gradient forms, before the rings' schedules."""
  lhs_spec, rhs_spec, out_spec = all_specs
  if mode not in MODES:
    raise ValueError(f'mode={mode!r} is not one of {MODES}')
  if ring_dtype not in RING_DTYPES:
    raise ValueError(f'ring_dtype={ring_dtype!r} is not one of {RING_DTYPES}')
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
        eq, shapes, all_specs, dtype, mesh, hardware, form, alone, accumulators)
  backward, backward_over = ('ring', 'ring'), (None, None)
  if mode == 'auto':
    choice = estimate.best
    reason = f'cost model ({estimate.hardware}) picks {choice}' + (
        ' (ring steps bound by HBM traffic)' if estimate.step_memory_bound else '')
    if choice == 'none':
      return _gradients_alone(
          Decision(str(eq), 'none', None, chosen.kind, others, estimate, reason,
                   ring_dtype=ring_dtype),
          eq, shapes, all_specs, dtype, mesh, hardware, form, alone, accumulators)
    if choice == 'unidirectional' and (estimate.seconds['bidirectional']
                                       < estimate.seconds['unidirectional']):
      reason += (f' (bidirectional models less than {cost_model.BIDIRECTIONAL_MIN_GAIN:.0%} '
                 'faster: the simpler ring)')
    rings, seconds, waits = _backward_forms(eq, chosen.axis, choice, shapes, all_specs, dtype,
                                            mesh, hardware, form, accumulators)
    backward = tuple('none' if r is None else 'ring' for r in rings)
    backward_over = tuple(None if r is None or r == (chosen.axis, choice) else r
                          for r in rings)
    reason += _gradient_reasons(chosen.axis, choice, rings, seconds, waits, accumulators)
    return Decision(str(eq), choice, chosen.axis, chosen.kind, others, estimate, reason,
                    backward, backward_over, seconds, ring_dtype=ring_dtype)
  choice, reason = mode, f'mode="{mode}"'
  if mode == 'always':  # a ring in the direction the cost model prefers where rings overlap
    choice = estimate.best_ring if overlapped else 'unidirectional'
    reason = f'mode="always": {choice}' + ('' if overlapped else ' (nothing overlaps on '
                                                                  f'{estimate.hardware})')
  return Decision(str(eq), choice, chosen.axis, chosen.kind, others, estimate, reason,
                  ring_dtype=ring_dtype)


def _gradient_reasons(axis, choice, rings, seconds, waits, accumulators) -> str:
  """What ``Decision.reason`` adds for each gradient einsum not run as the forward's ring
  (``_backward_forms``' rings, priced forms and waits)."""
  reason = ''
  for which, r, forms in zip(('lhs', 'rhs'), rings, seconds):
    if r is None and which == 'rhs' and accumulators == 'none':
      reason += "; gradient of rhs as one einsum (accumulators='none')"
    elif r is None and which in waits:
      reason += (f'; gradient of {which} as one einsum (its ring over {axis} would '
                 "wait for its transfers beside the data gradient's ring)")
    elif r is None and len(forms) > 1 + sum(k.startswith("compiler's") for k in forms):
      reason += f'; gradient of {which} as one einsum (its ring would be slower)'
    elif r is None:  # no ring was priced
      reason += f'; gradient of {which} as one einsum (no ring can run it' + (
          ": under accumulators='sharded' not the one over "
          f'{axis}' if accumulators == 'sharded' else '') + ')'
    elif r[0] != axis:
      reason += _blocking(which, r)
    elif r[1] != choice:
      reason += (f'; gradient of {which} {r[1]} (beside the next layer\'s gradient '
                 'rings, on both link directions)')
  return reason


def with_schedules(decision: Decision, lhs_shape, rhs_shape, *, mesh, lhs_spec, rhs_spec,
                   out_spec, hardware=None, prefer: Mapping[str, Any] | None = None,
                   dtype=jnp.float32) -> Decision:
  """``decision`` (``explain``'s, perhaps with its forms changed) with its rings' schedules
  chosen anew for them: the planner's, each field of ``prefer`` instead where it applies
  (``dtype``: the operands', which decides what fits a kernel's VMEM)."""
  profile = hardware if isinstance(hardware, hw.HardwareProfile) else hw.get_profile(
      hardware or cost_model.DEFAULT_HARDWARE)
  return _scheduled(decision, (lhs_shape, rhs_shape), (lhs_spec, rhs_spec, out_spec), mesh,
                    profile, schedule.check_prefer(prefer), jnp.dtype(dtype).itemsize)


def _scheduled(decision: Decision, shapes, specs, mesh, profile, prefer,
               itemsize: int) -> Decision:
  """``decision`` with the schedule of each ring it runs (``schedule.choose``)."""
  if not decision.decomposed:
    return decision
  cfg = static(decision, specs, mesh)
  eq = Equation.parse(decision.equation)
  sizes = {**dict(zip(eq.lhs, shapes[0])), **dict(zip(eq.rhs, shapes[1]))}
  out_shape = tuple(sizes[l] for l in eq.out)
  rings = ((cfg, shapes, decision.mode != 'none'),
           (cfg.transposed('lhs'), (out_shape, shapes[1]), decision.backward[0] == 'ring'),
           (cfg.transposed('rhs'), (shapes[0], out_shape), decision.backward[1] == 'ring'))
  gather = gather_first_spec(cfg) is not None
  schedules = tuple(
      schedule.choose(_ring_facts(c, s, i, gather and i == 2, profile.platform, itemsize),
                      profile.async_collectives, prefer)
      if runs and _is_ring(c) else None for i, (c, s, runs) in enumerate(rings))
  return dataclasses.replace(decision, schedules=schedules)


def ring_einsums(decision: Decision, specs) -> tuple[tuple[str, str] | None, ...]:
  """(equation, AxisPlan kind) of each ring ``decision`` runs (forward, lhs gradient, rhs
  gradient; None: no ring), the equation as the ring's scope names it in HLO
  (``SCOPE/KIND/DIRECTION/EQUATION``)."""
  cfg = static(decision, specs, None)
  rings = (cfg, cfg.transposed('lhs'), cfg.transposed('rhs'))
  return tuple((c.equation, axis_plan(c)[1].kind) if sc is not None else None
               for c, sc in zip(rings, decision.schedules))


def _is_ring(cfg: Static) -> bool:
  """Whether ``cfg``'s einsum runs as a ring (``_transpose_einsum``'s test)."""
  if cfg.axis is None:
    return False
  _, plans = einsum_plan.plan(cfg.equation, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  return any(p.axis == cfg.axis and p.kind in DECOMPOSABLE for p in plans)


def _ring_facts(cfg: Static, shapes, index: int, gather: bool, platform: str,
                itemsize: int) -> schedule.RingFacts:
  """What decides which schedule settings apply to the ring ``cfg`` runs on operands of
  ``shapes`` (ring ``index``: 0 the forward's, 1 and 2 the gradients')."""
  cfg, *shapes = gathered_dims_major(cfg, *shapes)
  eq, plan = axis_plan(cfg)
  specs = hoisted_specs(eq, cfg.axis, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  manual = (cfg.axis,) + manual_extra(cfg, eq, *specs)
  local = [_local_shape(shape, spec, manual, cfg.mesh) for shape, spec in zip(shapes, specs)]
  fused_fits, problem = False, 'an all-gather ring'
  if plan.kind == 'reducescatter':
    z = plan.out_letter
    (owner, other), other_letters = ((local, eq.rhs) if z in eq.lhs else
                                     (local[::-1], eq.lhs))
    fused_fits = halved_letter(eq, z, other_letters, other) is not None
    problem = _kernel_problem(cfg, eq, z, manual, owner, other, itemsize)
  return schedule.RingFacts(plan.kind, cfg.bidirectional, cfg.activation_out, index == 0,
                            fused_fits, problem, gather, platform, cfg.mesh.shape[cfg.axis])


def _kernel_problem(cfg: Static, eq: Equation, z: str, manual, owner_shape,
                    other_shape, itemsize: int) -> str:
  """Why the pair kernel (``_pair_kernel_ring``) cannot run a reduce-scatter ring ('' where
  it can): an even two-way weight-gradient ring whose shard_map holds every mesh axis of
  size > 1 manual (a Mosaic kernel needs all of them manual), in ``kernel_form``'s shapes,
  whose blocks of rows fit the kernel's VMEM (``pair_sums.vmem_problem``)."""
  n = cfg.mesh.shape[cfg.axis]
  others = [a for a in cfg.mesh.axis_names if a not in manual and cfg.mesh.shape[a] > 1]
  if cfg.activation_out:
    return 'its output is an activation'
  if not cfg.bidirectional or n % 2:
    return 'not an even two-way ring'
  if others:
    return f'mesh axis {others[0]} is not manual in its shard_map'
  form = kernel_form(eq, z, owner_shape, other_shape)
  if form is None:
    return "its operands are not [contracted..., sliced] and [contracted..., output's]"
  return pair_sums.vmem_problem(*form[:5], n, form[6], itemsize,
                                4 if cfg.wire_fp32 else itemsize)


def _local_shape(shape, spec, manual, mesh) -> tuple[int, ...]:
  """The block of a ``shape`` array laid out as ``spec`` that a shard_map manual over
  ``manual`` hands each device."""
  spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  return tuple(d // math.prod(mesh.shape[a] for a in einsum_plan.axes_of(e) if a in manual)
               for d, e in zip(shape, spec))


def _gradients_alone(plain: Decision, eq: Equation, shapes, specs, dtype, mesh, hardware,
                     form: _Priced, enabled: bool, accumulators: str) -> Decision:
  """``plain`` (a forward left to the compiler, under auto), with each gradient einsum
  that reduce-scatters over an axis as a ring over it where the cost model says that
  ring costs less than the compiler's reduce-scatter, which blocks the chip; only where
  ``enabled`` (``gradient_rings='any_forward'``), and the weight's gradient not under
  ``accumulators='none'``.

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
  rings, seconds, _ = _backward_forms(eq, None, None, shapes, specs, dtype, mesh, hardware,
                                      form, accumulators)
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
                    mesh, hardware, form: _Priced, accumulators: str):
  """(axis, mode) of each gradient einsum's ring (of lhs, rhs), or None: one einsum; the
  modeled seconds of each one's forms (``Decision.gradient_seconds``); and which gradients
  ('lhs', 'rhs') are one einsum only because their ring would wait for its links (below).
  Each rule below was kept because the compiled programs, planned with and without it,
  model faster with it; docs/parallelism.md has those programs' steps, and the rules tried
  and not kept.

  The candidates are one einsum, the ring over the forward's ``axis`` (in its ``mode``)
  and a ring over any other axis over which the gradient einsum reduce-scatters (a weight
  gradient over ``fsdp``, in that ring's best mode). Each is costed as its ring (or its
  einsum) plus the transfers of the collectives it leaves to the compiler: a reduce-scatter
  blocks the chip (synchronous under the TPU flags), an all-gather of the cotangent is
  waited for, and an all-gather of one of the forward's inputs, though the compiler
  prefetches it asynchronously, holds the links of the forward's axis while the other
  gradient's ring runs over them, so the two take turns (the step model's ``links``). The
  least wins; ties go to the forward's ring.

  The weight's gradient (of ``rhs``, the weight in ``Ops.einsum``) rings over the forward's
  axis bidirectionally whatever the forward's mode (``WEIGHT_GRADIENT_MODE``): it is off
  the critical path, and the scheduler runs it beside the next layer's data-gradient
  rings, which use both directions of the same links; unidirectional, all its transfers
  would queue on one of them.

  That ring is priced (for the report) but no candidate where its rounds wait for their
  transfers (``Estimate.link_bound``: a block's transfer outlasts the round's einsum over
  two blocks) while the data gradient's ring runs over the same axis: its transfers then
  overlap only its own einsums, on the links the data gradient's ring uses, where as one
  einsum the compiler's asynchronous gather of its operand overlaps any compute beside it.
  The per-einsum prices cannot see that; the compiled programs do.

  The cotangent's gather over the forward's axis is counted even where the data
  gradient's ring hands it on whole (``keeps_cotangent``), which the forms other than the
  forward's ring then save: not counting it moves dense_500b's ``attn.o`` weight gradient
  to the ring over fsdp, whose 128 short steps cost more than the model says.

  Under ``accumulators`` 'sharded' (``schedule.ACCUMULATORS``) an all-gather ring over the
  forward's axis is no candidate where the gradient is reduced over another axis afterwards:
  its accumulator would hold the gradient whole over that axis. Under 'none' the weight's
  gradient is one einsum (its forms still priced, for the report).

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
  rings, seconds, waits = [], {'lhs': {}, 'rhs': {}}, []
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
        accumulators == 'sharded' and plan.kind == 'allgather_contracting' and any(
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
    # priced for the report, but no candidate where it waits for its transfers on the links
    # the data gradient's ring over the same axis uses (docstring)
    queued = (which == 'rhs' and own_ring and rings[0] is not None and rings[0][0] == axis
              and est[axis].link_bound(own))
    best = min((r for r in total if not (queued and r == (axis, own))),
               key=lambda r: (total[r], r[0] != axis), default=None)  # ties: forward's
    ringed = best and total[best] <= plain and not (which == 'rhs' and accumulators == 'none')
    rings.append(best if ringed else None)
    if queued and not ringed and total[axis, own] <= plain:
      waits.append(which)
    seconds[which] = {'one einsum': plain, **{f'{m} over {a}': s for (a, m), s in total.items()},
                      **{f"compiler's collective over {a}": s for a, s in compiler.items()}}
  return tuple(rings), (seconds['lhs'], seconds['rhs']), tuple(waits)


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
  summed = summed_axes(eq, axis, lhs_spec, rhs_spec)
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
  after the ring (``summed_axes``).
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
