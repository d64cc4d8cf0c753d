"""Which collective a sharded einsum needs, along which mesh axis.

Given ``equation`` and the PartitionSpecs of both operands and the output,
:func:`plan` classifies every mesh axis that the specs mention:

* ``pass``: the axis shards the einsum consistently (a batch dimension
  sharded alike everywhere, or a free dimension sharded in its operand and in
  the output); no collective.
* ``allgather_free``: one operand (the *gathered* one) is sharded on a free
  (or batch) dimension that the output holds whole; the other operand is not
  sharded on that axis except on a free dimension the output shards alike.
  Decomposed: partial results are written at the shard's offset.
* ``allgather_contracting``: the gathered operand is sharded on a contracting
  dimension that the other operand holds whole. Decomposed: partial results
  are summed.
* ``reducescatter``: both operands are sharded on the same contracting
  dimension and the output is scattered on a free dimension that its operand
  holds whole. Decomposed: a partial-sum accumulator travels the ring.
* ``unsupported``: anything else (e.g. an all-reduce with a replicated
  output), with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec


@dataclasses.dataclass(frozen=True)
class Equation:
  lhs: str
  rhs: str
  out: str

  @classmethod
  def parse(cls, equation: str) -> 'Equation':
    try:
      ins, out = equation.replace(' ', '').split('->')
      lhs, rhs = ins.split(',')
    except ValueError:
      raise ValueError(f'einsum equation {equation!r} is not of the form "ab,bc->ac"') from None
    for letters in (lhs, rhs, out):
      if len(set(letters)) != len(letters) or not letters.isalpha():
        raise ValueError(f'einsum equation {equation!r}: each operand needs distinct letters')
    if set(out) - set(lhs + rhs) or (set(lhs) ^ set(rhs)) - set(out):
      raise ValueError(f'einsum equation {equation!r}: every output letter must come '
                       'from an operand and every letter of one operand only must be kept')
    return cls(lhs, rhs, out)

  def __str__(self):
    return f'{self.lhs},{self.rhs}->{self.out}'

  @property
  def contracting(self) -> set[str]:
    return (set(self.lhs) & set(self.rhs)) - set(self.out)


def axes_of(spec_entry: Any) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, an axis name, or several)."""
  if spec_entry is None:
    return ()
  return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
  """The PartitionSpec entry for mesh ``axes`` (None, one name or a tuple): inverts axes_of."""
  return (axes[0] if len(axes) == 1 else tuple(axes)) if axes else None


def letter_axes(letters: str, spec: PartitionSpec) -> dict[str, tuple[str, ...]]:
  """``{letter: mesh axes}`` for one operand; missing trailing entries are None."""
  if len(spec) > len(letters):
    raise ValueError(f'PartitionSpec {spec} has more entries than dims {letters!r}')
  entries = tuple(spec) + (None,) * (len(letters) - len(spec))
  return {l: axes_of(e) for l, e in zip(letters, entries)}


def _where(axis: str, axes_by_letter: dict[str, tuple[str, ...]]) -> list[str]:
  return [l for l, axes in axes_by_letter.items() if axis in axes]


@dataclasses.dataclass(frozen=True)
class AxisPlan:
  """What one mesh axis needs. ``gathered``: 'lhs' or 'rhs' for all-gathers."""
  axis: str
  kind: str
  gathered: str | None = None
  letter: str | None = None   # the sharded letter the collective is about
  out_letter: str | None = None  # reduce-scatter: the output dim scattered
  reason: str = ''


def classify_axis(eq: Equation, axis: str, lhs: dict, rhs: dict, out: dict) -> AxisPlan:
  """Classifies one mesh axis (see the module docstring)."""
  wl, wr, wo = _where(axis, lhs), _where(axis, rhs), _where(axis, out)
  if max(len(wl), len(wr), len(wo)) > 1:
    return AxisPlan(axis, 'unsupported', reason=f'{axis} shards several dims of one array')
  # Axis nesting order must match for shared dims; only single-axis entries
  # or identical tuples are understood.
  wl, wr, wo = (w[0] if w else None for w in (wl, wr, wo))
  contracting = eq.contracting
  if wl and wl == wr and wl in contracting:
    if wo is None:
      return AxisPlan(axis, 'unsupported', letter=wl,
                      reason=f'all-reduce over {axis}: the output is not scattered')
    owner = 'lhs' if wo in eq.lhs else 'rhs'
    holder = lhs if owner == 'lhs' else rhs
    if axis in holder.get(wo, ()):
      return AxisPlan(axis, 'unsupported', reason='scattered output dim is already sharded')
    if wo in eq.lhs and wo in eq.rhs:  # the ring slices one operand along it, not both
      return AxisPlan(axis, 'unsupported', reason=f'scattered dim {wo} is in both operands')
    return AxisPlan(axis, 'reducescatter', letter=wl, out_letter=wo)
  if _consistent(wl, wr, wo, eq):
    return AxisPlan(axis, 'pass')
  for side, g, o in (('lhs', wl, wr), ('rhs', wr, wl)):
    if g is None:
      continue
    other_ok = o is None or (o == wo and o not in contracting)
    if not other_ok:
      continue
    if g in contracting:
      if wo is None or wo == o:
        return AxisPlan(axis, 'allgather_contracting', gathered=side, letter=g)
    elif g != wo and (wo is None or wo == o) and g not in (eq.rhs if side == 'lhs' else eq.lhs):
      # (a batch dim of both operands would pass block by block against the other whole)
      return AxisPlan(axis, 'allgather_free', gathered=side, letter=g)
  return AxisPlan(axis, 'unsupported',
                  reason=f'{axis} on lhs {wl}, rhs {wr}, out {wo} fits no decomposed pattern')


def _consistent(wl, wr, wo, eq: Equation) -> bool:
  """The axis shards one letter alike wherever that letter appears."""
  letters = {w for w in (wl, wr, wo) if w}
  if len(letters) != 1:
    return not letters
  (letter,) = letters
  expected = (letter in eq.lhs, letter in eq.rhs, letter in eq.out)
  return expected == (wl == letter, wr == letter, wo == letter)


def plan(equation: str, lhs_spec, rhs_spec, out_spec) -> tuple[Equation, list[AxisPlan]]:
  """Classifies every mesh axis mentioned by the three specs."""
  eq = Equation.parse(equation)
  lhs, rhs, out = (letter_axes(l, s) for l, s in ((eq.lhs, lhs_spec), (eq.rhs, rhs_spec),
                                                    (eq.out, out_spec)))
  axes = []
  for mapping in (lhs, rhs, out):
    for entry in mapping.values():
      axes += [a for a in entry if a not in axes]
  return eq, [classify_axis(eq, a, lhs, rhs, out) for a in axes]
