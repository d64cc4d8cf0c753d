"""Plan files: a layer plan as JSON, to run again exactly as it was decided.

A training run writes the plan it ran to ``WORKDIR/plan.json``; ``parallelism.plan=PATH``
runs a saved plan instead of planning, and a run that resumes runs its workdir's plan.
Each layer keeps its decision whole (mode, axis, gradient forms, ring dtype and each ring's
schedule, ``parallelism/schedule.py``) with the specs and operand shapes it was made for;
a plan made for another model, mesh, chip or layer layout is refused in one line naming
the first mismatch (``sharding.plan_layers``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jax.sharding import PartitionSpec

from parallelism import cost_model, moe, schedule
from parallelism.decision import Decision

VERSION = 1
NAME = 'plan.json'


class PlanMismatch(ValueError):
  """A plan file that does not fit the model it is asked to run."""


def mismatch(saved: dict, mesh_shape: Mapping[str, int], hardware: str) -> tuple | None:
  """The first of a plan's (``read``) mesh and hardware that is not the run's, as (what,
  the plan's, the run's); None where both match. The plan's layers are matched as the model
  is traced (``sharding.plan_layers``)."""
  for what, planned, here in (('mesh', saved['mesh'], dict(mesh_shape)),
                              ('hardware', saved['hardware'], hardware)):
    if planned != here:
      return what, planned, here
  return None


@dataclasses.dataclass(frozen=True)
class SavedLayer:
  """One layer of a plan file: its decision, the specs and operand shapes it was made for."""
  decision: Any
  specs: tuple
  shapes: tuple


def to_json(layers: Mapping[str, SavedLayer], mesh_shape: Mapping[str, int],
            hardware: str) -> dict:
  """The plan as plan.json holds it."""
  return {'version': VERSION, 'mesh': dict(mesh_shape), 'hardware': hardware,
          'layers': {path: {'kind': 'exchange' if isinstance(l.decision, moe.ExchangeDecision)
                            else 'einsum',
                            'specs': [_spec_json(s) for s in l.specs],
                            'shapes': [list(s) for s in l.shapes],
                            'decision': dataclasses.asdict(l.decision)}
                     for path, l in layers.items()}}


def write(path: str, data: dict) -> None:
  """Writes ``data`` (``to_json``) to ``path`` whole: a temporary file, then renamed."""
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(data, f, indent=1)
    f.write('\n')
  os.replace(tmp, path)


def read(path: str) -> dict:
  """plan.json at ``path`` as ``{'mesh', 'hardware', 'layers': {path: SavedLayer}}``;
  ValueError in one line where it is no plan file this version writes."""
  if not os.path.isfile(path):
    raise ValueError(f'parallelism.plan={path!r} is not a file')
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
    if data.get('version') != VERSION:
      raise ValueError(f"version {data.get('version')!r}, not {VERSION}")
    layers = {name: SavedLayer(_decision(l['kind'], l['decision']),
                               tuple(_spec(s) for s in l['specs']),
                               tuple(tuple(s) for s in l['shapes']))
              for name, l in data['layers'].items()}
    return {'mesh': dict(data['mesh']), 'hardware': data['hardware'], 'layers': layers}
  except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
    raise ValueError(f'parallelism.plan={path!r} is no plan file: {type(e).__name__}: '
                     f'{e}'.splitlines()[0]) from None


def _spec_json(spec) -> Any:
  if isinstance(spec, PartitionSpec):
    return {'spec': [list(e) if isinstance(e, tuple) else e for e in spec]}
  return spec


def _spec(data) -> Any:
  return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in data['spec']])


def _decision(kind: str, d: dict):
  if kind == 'exchange':
    return moe.ExchangeDecision(**{**d, 'chunk_shape': tuple(d['chunk_shape'])})
  pairs = lambda v: tuple(None if x is None else tuple(x) for x in v)
  return Decision(**{
      **d, 'left_to_compiler': tuple(d['left_to_compiler']),
      'estimate': d['estimate'] and cost_model.Estimate(**{
          k: v for k, v in d['estimate'].items() if k != 'best'}),
      'backward': tuple(d['backward']), 'backward_over': pairs(d['backward_over']),
      'gradient_seconds': tuple(d['gradient_seconds']),
      'measured': tuple(tuple(m) for m in d.get('measured', ())),
      'schedules': tuple(s and schedule.RingSchedule(**s) for s in d['schedules'])})
