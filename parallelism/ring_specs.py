"""What a ring over one mesh axis looks like, from shapes and specs alone: the static facts
both the planner (parallelism/decision.py, which prices and schedules rings) and the rings
themselves (parallelism/collective_einsum.py) read.

``Static`` is one ring's configuration (its einsum, specs, axis, schedule), ``static`` makes
the forward's from a ``Decision``; the rest name the axes a ring's ``shard_map`` holds manual
(``summed_over``, ``manual_extra``), where its operands are hoisted (``hoisted_specs``), the
order its gathered dimensions take (``gathered_dims_major``) and the shapes the pair kernel
takes (``kernel_form``, ``halved_letter``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from parallelism import einsum_plan, schedule
from parallelism.einsum_plan import AxisPlan, Equation


def static(decision: Any, specs, mesh) -> 'Static':
  """The forward ring's ``Static`` (its gradients': ``transposed``) for ``decision``."""
  lhs_spec, rhs_spec, out_spec = (PartitionSpec(*s) for s in specs)
  return Static(decision.equation, mesh, lhs_spec, rhs_spec, out_spec, decision.axis,
                decision.mode == 'bidirectional', decision.ring_dtype == 'float32',
                decision.backward, decision.backward_over, decision.schedules,
                ring_order=decision.ring_order)


@dataclasses.dataclass(frozen=True)
class Static:
  """One ring's configuration: its einsum, specs, mesh axis, direction and schedule."""
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

  def transposed(self, which: str) -> 'Static':
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


def hands_cotangent_on(cfg: Static) -> bool:
  """Whether the data gradient's ring hands the cotangent it gathered on to the weight
  gradient's ring over another axis (``_decomposed_bwd``)."""
  eq, specs = Equation.parse(cfg.equation), (cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  return (cfg.backward == ('ring', 'ring') and cfg.backward_over[0] is None and
          cfg.backward_over[1] is not None and cfg.backward_over[1][0] != cfg.axis and
          keeps_cotangent(eq, cfg.axis, specs, cfg.mesh))


def gather_first_spec(cfg: Static):
  """The spec the weight gradient's ring over another axis takes ``lhs`` in, where the
  compiler gathers it over the forward's axis beside a two-way data-gradient ring (the
  schedule's ``gather`` applies there: ``_gathered_first``); else None."""
  if cfg.backward != ('ring', 'ring') or hands_cotangent_on(cfg):
    return None
  w, d = cfg.transposed('rhs'), cfg.transposed('lhs')
  if w.axis in (None, cfg.axis) or not d.bidirectional:
    return None
  spec, _ = hoisted_specs(Equation.parse(w.equation), w.axis, w.lhs_spec, w.rhs_spec,
                          w.out_spec)
  over_axis = lambda s: cfg.axis in {a for e in s for a in einsum_plan.axes_of(e)}
  return spec if over_axis(cfg.lhs_spec) and not over_axis(spec) else None


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
  return not [a for a in summed_axes(d_eq, axis, *hoisted) if mesh.shape[a] > 1]


def axis_plan(cfg: Static) -> tuple[Equation, AxisPlan]:
  eq, plans = einsum_plan.plan(cfg.equation, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  return eq, next(p for p in plans if p.axis == cfg.axis)


def summed_over(cfg: Static, eq: Equation, lhs_spec, rhs_spec) -> tuple[str, ...]:
  """Axes that shard a contracted dim of both operands (a weight gradient's batch): manual
  too, so partial sums accumulate over the ring and are reduced once after it, not once
  per step."""
  return tuple(a for a in summed_axes(eq, cfg.axis, lhs_spec, rhs_spec)
               if cfg.mesh.shape[a] > 1)


def manual_extra(cfg: Static, eq: Equation, lhs_spec, rhs_spec) -> tuple[str, ...]:
  """The ring's shard_map's manual axes besides its own: ``summed_over``'s, then axes that shard
  the einsum alike everywhere (an expert weight gradient's experts), where each device keeps
  its block. Left to the compiler inside the shard_map, it gathered them around the
  reduction over the summed axes (a v5p MoE program: every expert's gradient all-gathered
  and reduce-scattered, 16x the bytes)."""
  summed = summed_over(cfg, eq, lhs_spec, rhs_spec)
  passing = tuple(a for a in passing_axes(eq, cfg.axis, lhs_spec, rhs_spec, cfg.out_spec)
                  if a not in summed and cfg.mesh.shape[a] > 1)
  return summed + passing


def gathered_dims_major(cfg: Static, lhs, rhs):
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


def summed_axes(eq: Equation, axis: str, lhs_spec, rhs_spec) -> tuple[str, ...]:
  """Mesh axes (not ``axis``) sharding one contracted letter in both operands."""
  lhs = einsum_plan.letter_axes(eq.lhs, lhs_spec)
  rhs = einsum_plan.letter_axes(eq.rhs, rhs_spec)
  out = []
  for letter in eq.lhs:
    if letter in eq.rhs and letter not in eq.out and lhs[letter] == rhs[letter]:
      out += [a for a in lhs[letter] if a != axis and a not in out]
  return tuple(out)


def passing_axes(eq: Equation, axis: str, lhs_spec, rhs_spec, out_spec) -> tuple[str, ...]:
  """Mesh axes (not ``axis``) that shard every letter they touch alike in all three
  arrays (``einsum_plan``'s ``pass``): no collective, each device computes its block."""
  maps = [einsum_plan.letter_axes(l, s) for l, s in ((eq.lhs, lhs_spec), (eq.rhs, rhs_spec),
                                                     (eq.out, out_spec))]
  axes = sorted({a for m in maps for entry in m.values() for a in entry} - {axis})
  return tuple(a for a in axes if einsum_plan.classify_axis(eq, a, *maps).kind == 'pass')


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


def kernel_form(eq: Equation, z: str, owner_shape, other_shape):
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


def halved_letter(eq: Equation, z: str, letters: str, shape) -> str | None:
  """The output dimension along which a reduce-scatter ring's accumulator travels in
  halves (``ring._in_halves``): the largest of even size that the operand the ring
  does not slice carries (so each half's einsum reads half of it), or None."""
  even = [l for l in letters if l in eq.out and l != z and shape[letters.index(l)] % 2 == 0]
  return max(even, key=lambda l: shape[letters.index(l)], default=None)
