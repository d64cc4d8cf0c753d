"""How each ring runs: the schedule the planner chooses and ``run_decision`` follows.

A decomposed einsum has up to three rings (its forward and the two gradients'). Each one's
``RingSchedule`` is fixed when the layer is planned (``decision.explain``), kept in
its ``Decision`` and shown in the parallelism report; nothing about a ring is decided while
it is traced. The planner's rule (``choose``):

* On a profile whose transfers cannot overlap compute (the CPU's), every ring runs the
  simplest schedule: nothing it could overlap pays there.
* Elsewhere each ring takes the refinements that apply to it: a reduce-scatter ring's
  additions fused into its einsums, each accumulator in two halves that take turns (where
  the pair kernel fits, on a TPU, each two-way weight-gradient round one Pallas kernel that
  adds both directions' accumulators as it writes), a two-way all-gather round an einsum a
  block (no join and split of the pair), a forward reduce-scatter ring's own block computed
  while the last accumulators travel, a weight gradient's operand gathered before the data
  gradient's two-way ring, and no loop for a ring over at most ``NO_LOOP_DEVICES`` (else
  ``OVERLAPPED_UNROLL`` steps an iteration). The sliced operands keep the compiler's layout.

These are the settings the paper configs had been given by hand, made rules: planned alone,
seven of the eight paper programs model within 1% of their hand-set schedules or better,
v5p ``moe_1t`` 1.2% behind, where its ``launch.aot --tune`` plan file is faster than the
hand-set schedule (docs/parallelism.md has the table and the commands;
``launch.aot --schedule`` compiles any other setting to compare).
Each rule's reason and the compiled programs it was checked on: docs/parallelism.md.
A plan file (or a test) may set any field for a layer's rings (``prefer``): each ring takes
it where it applies to that ring, as the report then shows; ``accumulators`` sets which
weight-gradient rings the planner may choose (``ACCUMULATORS``; 'any' unless set).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

# The values of each field, the simplest first.
CHOICES = {
    'additions': ('apart', 'fused', 'kernel'),
    'pairs': ('joined', 'apart'),
    'last': ('fused', 'apart'),
    'gather': ('beside', 'before'),
    'layout': ('compiler', 'contiguous'),
}
# Which weight-gradient rings the planner may choose (``decision.explain``, from a plan's
# ``prefer``; ``launch.aot --tune`` compiles each): 'any' (the cost model's fastest form, the
# planner's own), 'sharded' (no ring whose accumulator holds the gradient whole over an
# axis it is reduced over afterwards, fsdp: the gradient rings over fsdp or is one einsum)
# or 'none' (every weight gradient one einsum: the compiler prefetches its gathers and
# overlaps them with the rest of the backward, which the per-einsum cost model cannot see).
ACCUMULATORS = ('any', 'sharded', 'none')
# Ring steps per loop iteration where transfers overlap compute: a ring over at most
# NO_LOOP_DEVICES runs with no loop (every step its own ops, no loop-carried copies of its
# blocks), a longer one OVERLAPPED_UNROLL steps an iteration (the loop's block copies and some
# additions go; a ring of at most that many steps runs with no loop).
NO_LOOP_DEVICES = 8
OVERLAPPED_UNROLL = 2


@dataclasses.dataclass(frozen=True)
class RingSchedule:
  """How one ring runs. Fields that do not apply to the ring hold their simplest value."""
  direction: str                # unidirectional | bidirectional
  unroll: int = 1               # ring steps per loop iteration
  # a reduce-scatter ring's additions of partial sums: apart (a pass after each einsum) |
  # fused (into the einsums, each accumulator in two halves that take turns) | kernel (each
  # two-way round one Pallas kernel for both directions, parallelism/pair_sums.py)
  additions: str = 'apart'
  pairs: str = 'joined'         # a two-way all-gather round: joined (one einsum) | apart
  last: str = 'fused'           # a forward reduce-scatter ring's own block: fused | apart
  gather: str = 'beside'        # a weight gradient ring's operand: beside | before
  layout: str = 'compiler'      # the sliced operands' layout: compiler | contiguous
  why_no_kernel: str = ''       # why the pair kernel does not run it, where it might

  def describe(self) -> str:
    """One line for the report: the fields that differ from the simplest schedule."""
    words = [self.direction[:3] + '.', f'unroll {self.unroll}']
    words += [f'{k} {getattr(self, k)}' for k, v in CHOICES.items() if getattr(self, k) != v[0]]
    return ', '.join(words)


class RingFacts(NamedTuple):
  """What of a ring decides which settings apply to it (``decision._ring_facts``)."""
  kind: str                 # the AxisPlan kind: allgather_free | allgather_contracting | ...
  bidirectional: bool
  activation_out: bool      # its output is an activation, not a weight's gradient
  forward: bool             # the forward's ring (not a gradient's)
  fused_fits: bool          # its accumulators can travel in halves (``_halved_letter``)
  kernel_problem: str       # '' where the pair kernel fits, else why not
  gather_applies: bool      # a weight gradient ring that the data gradient's ring gathers for
  platform: str             # the profile's platform: where a Mosaic kernel can run
  devices: int = 2          # on the ring


def check_prefer(prefer: Mapping[str, Any] | None) -> dict:
  """``prefer`` (field -> value) checked: ValueError naming the first bad key or value."""
  prefer, values = dict(prefer or {}), {'accumulators': ACCUMULATORS, **CHOICES}
  for key, value in prefer.items():
    if key == 'direction':  # an 'always' layer's rings (decision.explain)
      if value not in ('unidirectional', 'bidirectional'):
        raise ValueError(f"direction={value!r} is not one of ('unidirectional', "
                         "'bidirectional')")
    elif key == 'unroll':
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'unroll={value!r} must be an integer of at least 1')
    elif key not in values:
      raise ValueError(f'{key!r} is not a ring schedule setting: direction, unroll, '
                       f'{", ".join(values)}')
    elif value not in values[key]:
      raise ValueError(f'{key}={value!r} is not one of {values[key]}')
  return prefer


def choose(facts: RingFacts, overlapped: bool, prefer: Mapping[str, Any]) -> RingSchedule:
  """The schedule of one ring: the planner's rule (module docstring), each field of
  ``prefer`` instead where it applies to this ring (else ValueError naming it)."""
  rs = facts.kind == 'reducescatter'
  applies = {
      'additions': rs,
      'pairs': facts.kind == 'allgather_free' and facts.bidirectional,
      'last': rs and facts.forward,
      'gather': facts.gather_applies,
      'layout': True,
  }
  # the pair kernel is a Mosaic kernel: elsewhere Pallas would interpret it
  # the layout stays the compiler's: contiguous blocks took 0.11 s a step of copies off
  # dense_500b but cost moe_1t 10% and 4 GiB a chip (modeled), and no model says where
  best = {'additions': 'kernel' if facts.platform == 'tpu' else 'fused', 'pairs': 'apart',
          'last': 'apart', 'gather': 'before', 'layout': 'compiler'}
  fields = {}
  for key, values in CHOICES.items():
    want = prefer.get(key, best[key] if overlapped else values[0])
    fields[key] = _additions_for(facts, want) if key == 'additions' and applies[key] else (
        want if applies[key] else values[0])
  unroll = prefer.get('unroll', 1 if not overlapped else facts.devices
                      if facts.devices <= NO_LOOP_DEVICES else OVERLAPPED_UNROLL)
  wg_pair = rs and facts.bidirectional and not facts.activation_out
  why = facts.kernel_problem if wg_pair and fields['additions'] != 'kernel' else ''
  return RingSchedule('bidirectional' if facts.bidirectional else 'unidirectional', unroll,
                      why_no_kernel=why, **fields)


def _additions_for(facts: RingFacts, want: str) -> str:
  """A reduce-scatter ring's additions under ``want``, as far as they apply to it: the
  kernel where it fits; fused into the einsums in a one-way ring, or a two-way ring with
  an activation output (a weight gradient's, an einsum a direction, would read its
  activation twice a round: HBM-bound), where an output dimension halves evenly; else a
  pass of their own."""
  if want == 'kernel' and not facts.kernel_problem:
    return 'kernel'
  if want != 'apart' and facts.fused_fits and (facts.activation_out or
                                               not facts.bidirectional):
    return 'fused'
  return 'apart'
