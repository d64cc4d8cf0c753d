r"""The parallelism report: one row per dense layer, what its sharding implies
and what the parallelism layer decided. A run prints a summary at start (counts
per decision, the costliest layers) and writes every row to
``WORKDIR/parallelism_report.json``; print those as a table with

  python -m parallelism.report WORKDIR_OR_JSON

Times are modeled by parallelism/cost_model.py, not measured.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
from typing import Any, Mapping

from parallelism import cli, einsum_plan, moe, schedule
from parallelism.decision import ring_einsums

RINGS = ('forward', 'lhs gradient', 'rhs gradient')  # Decision.schedules, in order


def rows(plan: Mapping[str, Any]) -> list[dict]:
  """Report rows from a layer plan (``sharding.plan_layers``: path -> (decision, specs))."""
  out = []
  for path, (d, specs, *_) in plan.items():
    if isinstance(d, moe.ExchangeDecision):
      out.append(_exchange_row(path, d, specs))
      continue
    est = d.estimate
    out.append({
        'path': path,
        'einsum': d.equation,
        'sharded_dims': _sharded_dims(d.equation, specs),
        'collective': (f'{d.collective} over {est.axis}' if d.collective and est else
                       f"the compiler's over {', '.join(d.left_to_compiler)}"
                       if d.left_to_compiler else 'none needed'),
        'decision': d.mode,
        'reason': d.reason,
        'left_to_compiler': list(d.left_to_compiler),
        'modeled_step_compute_us': est and round(est.step_compute_seconds * 1e6, 3),
        'modeled_step_transfer_us': est and round(est.step_transfer_seconds * 1e6, 3),
        'modeled_step_memory_bound': est and est.step_memory_bound,
        'gradients': {w: d.gradient(k) for k, w in enumerate(('lhs', 'rhs'))}
                      if d.decomposed else None,
        'modeled_seconds': est and est.seconds,
        'modeled_gradient_seconds': {w: d.gradient_seconds[k] for k, w in
                                     enumerate(('lhs', 'rhs')) if d.gradient_seconds[k]},
        # which array keeps the ring's order (its blocks as the rings pass them), if any
        'ring_order': d.ring_order or None,
        # how each ring runs (parallelism/schedule.py): the forward's and the gradients'
        'schedules': {ring: dataclasses.asdict(sc) for ring, sc in zip(RINGS, d.schedules)
                      if sc is not None},
        # parallelism.tune=measure: each form tried, ms on the devices (parallelism/tune.py)
        'measured_ms': {f: round(s * 1e3, 3) for f, s in d.measured} or None,
    })
  return out


def _exchange_row(path: str, d: 'moe.ExchangeDecision', specs) -> dict:
  """An MoE layer's expert all-to-all (modeled times are for the whole layer)."""
  return {
      'path': path,
      'einsum': 'becd->ebcd (experts)',
      'sharded_dims': '; '.join(
          f'{name} ' + (','.join(f'{l}@{"+".join(a)}' for l, a in
                                 einsum_plan.letter_axes(letters, spec).items() if a) or '-')
          for name, letters, spec in (('in', 'becd', specs[0]), ('at experts', 'ebcd', specs[1]))),
      'collective': f'all_to_all over {d.axis}' if d.axis else 'none needed',
      'decision': d.mode if d.mode == 'single' else f'chunked x{d.chunks}',
      'reason': d.reason,
      'left_to_compiler': [],
      'chunk_shape': list(d.chunk_shape),
      'modeled_single_us': round(d.seconds['single'] * 1e6, 3),
      'modeled_chunked_us': round(d.seconds['chunked'] * 1e6, 3),
  }


def _sharded_dims(equation: str, specs) -> str:
  eq = einsum_plan.Equation.parse(equation)
  parts = []
  for name, letters, spec in (('lhs', eq.lhs, specs[0]), ('rhs', eq.rhs, specs[1]),
                              ('out', eq.out, specs[2])):
    dims = [f'{l}@{"+".join(a)}' for l, a in einsum_plan.letter_axes(letters, spec).items() if a]
    parts.append(f'{name} {",".join(dims) or "-"}')
  return '; '.join(parts)


def table(report_rows: list[dict]) -> str:
  """A fixed-width text table of the rows."""
  head = ('layer', 'einsum', 'sharded dims', 'collective', 'decision', 'step us (modeled)',
          'gradients (modeled)', 'ring schedules')
  lines = [head]
  for r in report_rows:
    if 'modeled_single_us' in r:
      step = f"layer {r['modeled_single_us']:.1f} single / {r['modeled_chunked_us']:.1f} chunked"
    elif r['modeled_step_compute_us'] is None:
      step = '-'
    else:
      step = f"{r['modeled_step_compute_us']:.1f} / {r['modeled_step_transfer_us']:.1f}"
    decision = r['decision'] + (f", {r['ring_order']} in ring order" if r.get('ring_order')
                                else '')
    lines.append((r['path'], r['einsum'], r['sharded_dims'], r['collective'], decision,
                  step, _gradients(r), _schedules(r)))
  widths = [max(len(str(l[i])) for l in lines) for i in range(len(head))]
  fmt = lambda l: '  '.join(str(c).ljust(w) for c, w in zip(l, widths)).rstrip()
  return '\n'.join([fmt(lines[0]), fmt(['-' * w for w in widths])] + [fmt(l) for l in lines[1:]])


def _gradients(row: dict) -> str:
  """How each gradient einsum runs, with the modeled ms of that form and of one einsum
  where the cost model weighed them (``modeled_gradient_seconds``)."""
  seconds = row.get('modeled_gradient_seconds') or {}
  axis = row['collective'].rpartition(' over ')[2]
  cells = []
  for which, how in (row.get('gradients') or {}).items():
    forms = seconds.get(which, {})
    form = {'ring': f"{row['decision']} over {axis}", 'none': 'one einsum'}.get(how, how)
    cell = f'{which} {how}'
    if form in forms:
      cell += f' {forms[form] * 1e3:.2f} ms'
      if form != 'one einsum':
        cell += f" (one einsum {forms['one einsum'] * 1e3:.2f})"
    cells.append(cell)
  return '; '.join(cells) or '-'


def _schedules(row: dict) -> str:
  """Each ring's schedule, as ``RingSchedule.describe`` words it ('-': no ring)."""
  return '; '.join(f'{ring}: ' + schedule.RingSchedule(**sc).describe() + (
      f" (no kernel: {sc['why_no_kernel']})" if sc['why_no_kernel'] else '')
                   for ring, sc in (row.get('schedules') or {}).items()) or '-'


def kernel_rings(plan: Mapping[str, Any]) -> list[str]:
  """The rings whose schedule runs the pair kernel, labelled as ``launch.aot``'s
  ``kernels_by_ring`` labels the rings it finds running one in the compiled program."""
  out = []
  for path, (d, specs, *_) in plan.items():
    if isinstance(d, moe.ExchangeDecision) or not d.decomposed:
      continue
    for i, (sc, ring) in enumerate(zip(d.schedules, ring_einsums(d, specs))):
      if sc is not None and sc.additions == 'kernel':
        out.append(ring_label(path, bool(i), ring[0], ring[1], sc.direction))
  return sorted(out)


def ring_label(layer: str, backward: bool, equation: str, kind: str, direction: str) -> str:
  """A ring's name in the plan's and the compiled program's lists of rings (launch.aot's
  ``kernels_by_ring``, ``additions_by_ring``): 'LAYER[ (bwd)]: EQUATION (KIND, DIRECTION)'."""
  return f"{layer}{' (bwd)' if backward else ''}: {equation} ({kind}, {direction})"


def runs_a_ring(row: dict) -> bool:
  """Whether a dense layer's row runs any ring: its forward, or a gradient beside a plain
  forward."""
  return row['decision'] != 'none' or any(
      g != 'none' for g in (row.get('gradients') or {}).values())


def modeled_us(row: dict) -> float | None:
  """Modeled microseconds of the layer as decided (None: no collective, nothing modeled)."""
  if 'modeled_single_us' in row:
    return row['modeled_single_us' if row['decision'] == 'single' else 'modeled_chunked_us']
  seconds = row.get('modeled_seconds') or {}
  return seconds[row['decision']] * 1e6 if row['decision'] in seconds else None


def summary(report_rows: list[dict], policy: Any, path: str, costliest: int = 3) -> str:
  """A few lines for the start of a run: counts per decision, the costliest layers."""
  dense = [r for r in report_rows if 'modeled_single_us' not in r]
  exchanges = [r for r in report_rows if 'modeled_single_us' in r]
  decomposed = sum(map(runs_a_ring, dense))
  chunked = sum(r['decision'] != 'single' for r in exchanges)
  moe_note = f', {chunked}/{len(exchanges)} expert all-to-alls chunked' if exchanges else ''
  counts = collections.Counter(r['decision'] for r in report_rows).most_common()
  timed = sorted((r for r in report_rows if modeled_us(r) is not None), key=modeled_us,
                 reverse=True)[:costliest]
  return '\n'.join([
      f'parallelism: collective_matmul={policy.collective_matmul}, {decomposed}/{len(dense)} '
      f'dense layers decomposed{moe_note} (times modeled for {policy.hardware})',
      '  decisions: ' + ', '.join(f'{d} {n}' for d, n in counts),
      '  costliest (modeled): ' + (', '.join(f"{r['path']} {modeled_us(r):.1f} us"
                                             for r in timed) or 'nothing modeled'),
      f'  every layer: {path} (as a table: python -m parallelism.report '
      f'{os.path.dirname(path) or "."})'])


def write(path: str, report_rows: list[dict], policy: Any) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump({'policy': dataclasses.asdict(policy),
               'note': 'step times are modeled (parallelism/cost_model.py), not measured',
               'layers': report_rows}, f, indent=1)
    f.write('\n')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m parallelism.report', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('path', help='a workdir, or its parallelism_report.json')
  path = parser.parse_args(argv).path
  if os.path.isdir(path):
    path = os.path.join(path, 'parallelism_report.json')
  try:
    with open(path, encoding='utf-8') as f:
      report_rows = json.load(f)['layers']
  except (OSError, ValueError, KeyError, TypeError) as e:
    print(f'error: {path}: not a readable parallelism report ({e})', file=sys.stderr)
    return 2
  print(table(report_rows))
  return 0


if __name__ == '__main__':
  cli.run(main)
