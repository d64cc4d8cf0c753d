r"""Checks the step model against measured MFU: MaxText's published TPU v4, v5e and v5p results.

  python -m benchmarks.calibrate [--configs A.py,B.py] [--topology T] [--config.a.b=v ...]
                                 [--fit] [--tolerance 5] [--hlo_dir DIR] [--json]
  python -m benchmarks.calibrate --render

For each calibration config (default: ``configs/calibration/maxtext_*_*.py``)
the train step is compiled for its TPU slice exactly as ``launch.aot``'s
``maxtext`` variant does (the chip's default flags, which are MaxText's, and
XLA's windowed einsum at its default threshold: what MaxText ran), one compile
at a time (libtpu allows one process). The step model
(parallelism/step_model.py) then gives a modeled step time and MFU, printed
next to the measured MFU (``aot.measured_mfu`` of the config) and the error in
points. Exit status 1 when a row is off by more than ``--tolerance`` points, or when a row's
compiled program needs more memory than its chip gives one program: no chip could have run
it, and the compiler schedules such a program otherwise (configs/calibration/maxtext.py).

``--config.*`` overrides and ``--topology`` apply to every config, so another
published shape is checked the same way, e.g. MaxText's 128B on v5p-512 (68.83%):

  python -m benchmarks.calibrate --configs configs/calibration/maxtext_128b_v5p.py \
      --topology v5p:4x8x8 --config.mesh.fsdp=32 --config.batch_size=256 \
      --config.aot.measured_mfu=0.6883

``--fit`` searches the model's two fitted constants (``step_model.FITTED``)
for the smallest worst-row error over the rows compiled, re-reading the
compiled programs, and prints them; the constants in parallelism/step_model.py
are set from this output by hand. With more than one row it prints the leave-one-out
error: each row's error when ``matmul_efficiency`` is fitted on the other rows alone.
Without overrides MaxText's rows (its single-slice v4 runs, 22B and 52B, its v5e 16B and its
v5p runs, 32B, 64B, 128B, 256B and 512B) are written to docs/calibration.md with a
plot (docs/calibration.png), and with the fit's result (searched then, ``--fit`` or not).

The measured MFU is compared over the FLOPs our MFU counts: a row whose measurement
counted every (query, key) pair of causal attention (``aot.measured_attention='full'``,
MaxText's published v5p table) is scaled by our count over its (``on_our_count``).
``--render`` compiles nothing: it rewrites docs/calibration.md from docs/calibration.json,
each row's measurement read again from its config.

``--hlo_dir DIR --reuse`` models the programs an earlier run kept in DIR instead of compiling
them again, where the row's config, slice, compiler flags and compiler are the same (each row
keeps them in ``DIR/NAME/row.json``): a change to the step model is checked in seconds.

Every MFU this prints other than "measured" is modeled, not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import importlib.util
import itertools
import json
import os
import sys
import tempfile

from launch import aot
from parallelism import hardware, hlo_text, step_model
from trainer import config as config_lib, metrics
from trainer.hints import install_hint
from trainer.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Measured rows our programs cannot reproduce: kept as configs, left out of the default rows,
# and shown in docs/calibration.md with why (name -> why).
NOT_REPRODUCED = {
    'maxtext_128b_v5e': (
        'our program at its layout (FSDP 16 x tensor 16) needs 19.6 GiB per chip at MaxText\'s '
        'batch of one sequence a chip, above the 14.75 GiB a v5e chip gives one program, and '
        'the compiler refuses it at half that batch (16.34 of 15.75 GiB); compiled at one a '
        'chip with the compiler flags its source set, which do not include '
        '`--xla_enable_async_collective_permute`, today\'s compiler (libtpu 0.0.42) runs every '
        'one of its 22,882 collective-permutes a step synchronously, and the model reads 28.3% '
        'MFU against 55.2% measured. Neither is the program MaxText ran in 2023.'),
}
# MaxText's measured rows: configs/calibration/maxtext_<size>_<chip>.py, by chip then size
CONFIGS = sorted((p for p in glob.glob(os.path.join('configs', 'calibration', 'maxtext_*_*.py'),
                                       root_dir=ROOT)
                  if os.path.basename(p)[:-3] not in NOT_REPRODUCED),
                 key=lambda p: (p[:-3].split('_')[-1], int(p.split('_')[1][:-1])))
DOC = os.path.join(ROOT, 'docs', 'calibration.md')
PLOT = os.path.join(ROOT, 'docs', 'calibration.png')
SOURCE = ('MaxText/configs/v5p/README.md (AI-Hypercomputer/maxtext), measured on one slice '
          'with the commands in MaxText/configs/v5p/*.sh; its TPU v4 README table of '
          '2023-04-27 (commit 281e04bf3), measured with MaxText/configs/1xv4-128.sh and '
          '1xv4-384.sh then; and its TPU v5e README table of 2023-10-27 (commit 9bc243c95), '
          'measured with MaxText/configs/largest_job/16b.sh then '
          '(configs/calibration/SOURCES.md quotes each)')


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m benchmarks.calibrate', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--configs', default=','.join(CONFIGS),
                      help='comma-separated calibration configs (default: the MaxText rows)')
  parser.add_argument('--topology', default=None, help="TPU slice (default: each config's)")
  parser.add_argument('--fit', action='store_true', help='search the fitted constants')
  parser.add_argument('--tolerance', type=float, default=step_model.TOLERANCE_POINTS,
                      help='MFU points allowed')
  parser.add_argument('--hlo_dir', default=None, help='keep the compiled programs here')
  parser.add_argument('--reuse', action='store_true',
                      help='with --hlo_dir: model the programs a run kept there for the same '
                           'inputs instead of compiling them again (seconds, not minutes)')
  parser.add_argument('--json', action='store_true', help='print one JSON object')
  parser.add_argument('--render', action='store_true',
                      help='compile nothing: rewrite docs/calibration.md from '
                           'docs/calibration.json, each row measured as its config says now')
  return parser.parse_known_args(argv)


@dataclasses.dataclass
class Row:
  """One calibration config compiled, with what the model needs to re-model it."""
  config: str
  topology: str
  chips: int
  parameters: int
  model_flops_per_chip: float
  measured_mfu: float  # on our FLOP count (causal attention), as the modeled MFU
  hlo_path: str
  coords: list | None
  memory_gib: float
  published_mfu: float = 0.0  # as published, on the measurement's own FLOP count
  program_flops_per_chip: float = 0.0
  # collective-permutes a step (rings: XLA's windowed einsum), and of them those with
  # compute scheduled between start and done
  permutes: float = 0.0
  overlapped_permutes: float = 0.0
  modeled: dict = dataclasses.field(default_factory=dict)
  alternative: dict = dataclasses.field(default_factory=dict)  # under step_model.ALTERNATIVE

  def chip(self, constants: dict | None = None) -> step_model.Chip:
    """The step model's chip for this row's slice: calibrated, or with ``constants`` (some
    of ``step_model.FITTED``; the others at the data sheet's 1.0)."""
    chip = step_model.Chip.from_profile(aot.parse_topology(self.topology)[0].name)
    if constants is None:
      return chip
    return dataclasses.replace(chip, **({k: 1.0 for k in step_model.FITTED} | constants))

  def model(self, chip: step_model.Chip) -> dict:
    r = _analyzed(self.hlo_path, chip, self.coords)
    self.program_flops_per_chip = r.flops
    permutes = [p for p in r.pairs if p['kind'] == 'collective-permute']
    self.permutes = sum(p['executions'] for p in permutes)
    self.overlapped_permutes = sum(p['executions'] for p in permutes
                                   if p['compute_between_us'] > 0)
    mfu = self.model_flops_per_chip / (chip.peak_flops * r.step_seconds)
    self.modeled = {'step_seconds': r.step_seconds, 'compute_seconds': r.compute_seconds,
                    'matmul_at_peak_seconds': r.flops / chip.matmul_rate,
                    'exposed_comm_seconds': r.exposed_comm_seconds, 'mfu': mfu,
                    'error_points': 100 * (mfu - self.measured_mfu)}
    return self.modeled


_PARSED: dict = {}   # hlo_path -> its parsed module
_ANALYZED: dict = {}  # (hlo_path, chip) -> step_model.Result: fits re-read rows per grid point


def _analyzed(hlo_path: str, chip: step_model.Chip, coords) -> step_model.Result:
  """``step_model.analyze`` of a row's program on ``chip``, parsed once and modeled once
  per chip (the fit and leave-one-out search one grid of chips over every row)."""
  if (hlo_path, chip) not in _ANALYZED:
    if hlo_path not in _PARSED:
      with open(hlo_path, encoding='utf-8') as f:
        _PARSED[hlo_path] = hlo_text.parse(f.read())
    _ANALYZED[hlo_path, chip] = step_model.analyze(_PARSED[hlo_path], chip, coords)
  return _ANALYZED[hlo_path, chip]


def check_row(path: str, args, overrides, hlo_dir: str) -> tuple:
  """Loads and checks ``path`` as launch.aot would, compiling nothing (raises ConfigError)."""
  if not config_lib.load(path, overrides).aot.measured_mfu:
    raise ConfigError(f'{path} has no aot.measured_mfu (the measurement to check against)')
  ns = argparse.Namespace(config=path, topology=args.topology, variants='maxtext',
                          hlo_dir=os.path.join(hlo_dir, _name(path)), flag_set='')
  return (ns,) + aot.load(ns, overrides)


ROW_FILE = 'row.json'  # beside a row's kept program (--hlo_dir): what --reuse reads back


def _program_key(cfg, topology: str, flags: str) -> str:
  """What a row's compiled program depends on: its config, slice, compiler flags and the
  compiler's version (a program kept for other inputs is compiled again)."""
  try:
    compiler = importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    compiler = ''
  return json.dumps([dataclasses.asdict(cfg), topology, flags, compiler], sort_keys=True,
                    default=str)


def stored_row(checked: tuple) -> Row | None:
  """The row ``compile_row`` kept in its ``--hlo_dir`` for these same inputs, or None."""
  ns, cfg, topology, chip, *_ = checked
  try:
    with open(os.path.join(ns.hlo_dir, ROW_FILE), encoding='utf-8') as f:
      stored = json.load(f)
  except (OSError, ValueError):
    return None
  key = _program_key(cfg, topology, hardware.compiler_flags(chip, cfg.hardware.xla_flags))
  if stored.get('key') != key or not os.path.exists(stored['row'].get('hlo_path', '')):
    return None
  return Row(**{k: v for k, v in stored['row'].items() if k in Row.__dataclass_fields__})


def compile_row(checked: tuple, overrides, progress: str) -> Row:
  """Compiles the ``maxtext`` variant of a row ``check_row`` checked."""
  ns, cfg, topology, chip, chips, _, info = checked
  path = ns.config
  print(f'[{progress}] {path}: compiling (one at a time)...', file=sys.stderr, flush=True)
  flags = hardware.compiler_flags(chip, cfg.hardware.xla_flags)
  r = aot.run_variant(ns, overrides, 'maxtext', topology, flags)
  if 'error' in r:
    raise RuntimeError(f"{path}: {r['error']}")
  if 'model' not in r:  # the compiler refused it (out of memory): nothing to model
    raise RuntimeError(f"{path}: the compiler refused it on {topology}: "
                       f"{r['memory'].get('compiler_message', '')[:300]}")
  if not r['memory']['fits']:  # compiled, but no chip could run it: not what was measured
    raise RuntimeError(
        f"{path}: our program needs {r['memory']['total'] / aot.GIB:.1f} GiB per chip, above "
        f"the {chip.usable_hbm_bytes / aot.GIB:.2f} GiB a {topology.split(':')[0]} chip gives "
        'one: it could not run where it was measured (the compiler schedules such a program '
        'otherwise); check it at a batch that fits (--config.batch_size)')
  row = Row(path, topology, chips, info['parameters'],
            info['model_flops_per_step'] / chips, on_our_count(cfg),
            os.path.join(ns.hlo_dir, 'maxtext.hlo.txt'), r.get('coords'),
            r['memory']['total'] / aot.GIB, cfg.aot.measured_mfu)
  os.makedirs(ns.hlo_dir, exist_ok=True)
  with open(os.path.join(ns.hlo_dir, ROW_FILE), 'w', encoding='utf-8') as f:
    json.dump({'key': _program_key(cfg, topology, flags), 'row': dataclasses.asdict(row)}, f)
  return row


def on_our_count(cfg) -> float:
  """``aot.measured_mfu`` over the FLOPs our MFU counts (each (query, key) pair of causal
  attention once): the same step time over another count scales the MFU by ours over
  theirs. ``aot.measured_attention`` says what the measurement counted: every pair
  (``full``: MaxText's MFU before its PR #1988, as its published v5p table), no attention
  at all (``none``: 6 x parameters a token, MaxText's TFLOP/s in 2023, its v4 table), or
  as we do (``causal``)."""
  if cfg.aot.measured_attention == 'causal':
    return cfg.aot.measured_mfu
  m = cfg.transformer()
  ours = metrics.flops_per_token(m, cfg.seq_len)
  theirs = {'full': metrics.flops_per_token(m, cfg.seq_len, causal=False),
            'none': 6 * metrics.matmul_params(m)}[cfg.aot.measured_attention]
  return cfg.aot.measured_mfu * ours / theirs


def _record(r: Row) -> dict:
  skip = ('coords', 'hlo_path')  # a temporary file, and 512 chip coordinates
  return {k: v for k, v in dataclasses.asdict(r).items() if k not in skip} | {
      'config': _name(r.config)}


def _name(path: str) -> str:
  return os.path.splitext(os.path.basename(path))[0]


def search(rows: list[Row], names) -> dict:
  """The values of the fitted constants ``names`` (the others at the data sheet's 1.0)
  with the smallest worst-row |error| over ``rows`` (a coarse grid, then a fine one), each
  row on its own chip."""
  def worst(values) -> float:
    return max(abs(r.model(r.chip(dict(zip(names, values))))['error_points']) for r in rows)

  coarse = [0.5 + 0.05 * i for i in range(11)]
  best = min(itertools.product(*[coarse] * len(names)), key=worst)
  fine = [[round(b + 0.01 * i, 3) for i in range(-4, 5) if 0 < b + 0.01 * i <= 1]
          for b in best]
  best = min(itertools.product(*fine), key=worst)
  return dict(zip(names, best)) | {'worst_error_points': worst(best)}


def fit(rows: list[Row]) -> dict:
  """The fitted constants minimizing the worst row's |error|: both together, and each alone
  with the other at the data sheet's rate (1.0), since the rows may not tell them apart
  (the step model's docstring)."""
  return {'both': search(rows, step_model.FITTED)} | {
      f'{name} alone': search(rows, (name,)) for name in step_model.FITTED}


LEFT_OUT_FIT = ('matmul_efficiency',)  # the form of the fit the constants set take


def leave_one_out(rows: list[Row]) -> dict:
  """Each row's error under the constants fitted (``LEFT_OUT_FIT``, as ``search``) on all
  the other rows: config -> {'fitted': value, 'error_points'}. It says how far the model
  misses a program it was not fitted to, which the in-sample worst error understates."""
  out = {}
  for r in rows:
    found = {k: v for k, v in search([o for o in rows if o is not r], LEFT_OUT_FIT).items()
             if k in LEFT_OUT_FIT}
    out[_name(r.config)] = {'fitted': found,
                            'error_points': r.model(r.chip(found))['error_points']}
  return out


def not_reproduced_note() -> str:
  """The measured rows left out (``NOT_REPRODUCED``), each with why."""
  rows = ' '.join(f'`configs/calibration/{name}.py`: {why}' for name, why in
                  NOT_REPRODUCED.items())
  return ('**Rows not reproduced.** Measured rows our programs cannot reproduce are kept as '
          'configs and left out of the fit (`calibrate.NOT_REPRODUCED`; `python -m '
          f'benchmarks.calibrate --configs PATH` checks one, and refuses it): {rows}')


def loo_note(held_out: dict | None) -> str:
  """The leave-one-out errors as a paragraph of docs/calibration.md."""
  if not held_out:
    return ''
  each = ', '.join(f"{k} {v['error_points']:+.1f} (fitted "
                   + ', '.join(f'{n} {x}' for n, x in v['fitted'].items()) + ')'
                   for k, v in held_out.items())
  worst = max(abs(v['error_points']) for v in held_out.values())
  return (f'**Leave-one-out.** Each row modeled with `{", ".join(LEFT_OUT_FIT)}` fitted on '
          f'the other rows alone (`calibrate.leave_one_out`): {each}. Worst **{worst:.1f} '
          'points**: the error to expect on a program the model was not fitted to.')


def table(rows: list[Row]) -> list[str]:
  head = ('config', 'slice', 'chips', 'parameters', 'GiB/chip', 'published MFU',
          'measured MFU (our FLOP count)', 'modeled MFU', 'error (points)', 'modeled step s',
          'matmul at fitted rate s',
          'memory-bound s', 'exposed comm s', 'program/model FLOPs',
          'ring permutes a step (overlapped)')
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for r in rows:
    m = r.modeled
    lines.append(
        f'| {_name(r.config)} | {r.topology} | {r.chips} | {r.parameters / 1e9:.1f}B | '
        f'{r.memory_gib:.1f} | {r.published_mfu:.2%} | {r.measured_mfu:.2%} | '
        f'{m["mfu"]:.2%} | '
        f'{m["error_points"]:+.1f} | {m["step_seconds"]:.3f} | '
        f'{m["matmul_at_peak_seconds"]:.3f} | '
        f'{m["compute_seconds"] - m["matmul_at_peak_seconds"]:.3f} | '
        f'{m["exposed_comm_seconds"]:.3f} | '
        f'{r.program_flops_per_chip / r.model_flops_per_chip:.2f} | '
        f'{r.permutes:,.0f} ({r.overlapped_permutes:,.0f}) |')
  return lines


def memory_note(rows: list[Row]) -> str:
  """Which rows' programs need more memory per chip than a chip gives one program."""
  gib = lambda r: hardware.TPU_PREFIXES[r.topology.split(':')[0]].usable_hbm_bytes / 2**30
  over = [r for r in rows if r.memory_gib > gib(r)]
  if not over:
    return '**Memory.** Every row\'s program fits a chip.'
  joined = lambda items: ' and '.join(', '.join(items).rsplit(', ', 1))
  chips = sorted({f'{gib(r):.2f} GiB a {r.topology.split(":")[0]} chip' for r in over})
  it, that, noun, needs = (('them', 'those programs', "rows' programs", 'need') if len(over) > 1
                            else ('it', 'that program', "row's program", 'needs'))
  text = (f'The {joined(_name(r.config) for r in over)} {noun} {needs} '
          f'{joined(f"{r.memory_gib:.1f}" for r in over)} GiB per chip (the GiB/chip column, '
          f'the compiler\'s `memory_analysis()`), above the {joined(chips)} gives one program '
          f'(`launch.aot` would mark {it} DOES NOT FIT); the compiler compiled {it} all the same, '
          f'and the model reads {that} (each config\'s docstring says why).')
  fit_count = len(rows) - len(over)
  return f'**Memory.** {text}' + (f' The other {fit_count} fit.' if fit_count else '')


def findings(rows: list[Row], worst: float) -> str:
  """What the errors say, from their signs and size."""
  errors = [r.modeled['error_points'] for r in rows]
  side = ('above' if min(errors) > 0 else 'below' if max(errors) < 0 else 'on both sides of')
  text = (f'**What the calibration shows.** The modeled MFU of our compiled programs is {side} '
          f'MaxText\'s measured MFU ({min(errors):+.1f} to {max(errors):+.1f} points), ')
  target = f'{step_model.TOLERANCE_POINTS:g}-point target'
  text += (f'within the {target} on every row. ' if worst <= step_model.TOLERANCE_POINTS else
           f'outside the {target} on some rows. ')
  text += ('The modeled step is matmul time at the fitted rate plus memory-bound compute plus '
           'exposed communication. ')
  if min(errors) > 0:
    text += ('Modeled above measured is the direction the model\'s simplifications point to: '
             'it counts no MXU stalls or kernel overheads beyond its constants, and transfers '
             'that share a link take turns at its full rate (no congestion, no routing). ')
  return text + (
      'Our programs '
      'match MaxText\'s in the two terms that decide most of the memory-bound and exposed '
      'time: the splash attention kernel (no [t, s] logits in HBM; '
      '`--config.model.attention=xla` compiles without it) and bf16 partial sums on the wire '
      '(`--config.parallelism.ring_dtype=float32` compiles fp32 ones).')


def same_shape_note(rows: list[Row], apart: float = 1.5) -> str:
  """Rows whose layers have one shape (widths and sequence length), compared per layer and
  sequence a chip runs: the measured step, our program's matmuls at the fitted rate, and
  what the measurement leaves for everything else beside what the model charges for it.
  The matmul rate scales every row's matmuls alike, so where the measurements leave such
  rows room ``apart`` times or more different for the same layer's other work, no value
  of it fits them together."""
  groups = {}
  for r in rows:
    cfg = config_lib.load(os.path.join(ROOT, r.config), [])
    m = cfg.model
    key = (m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, cfg.seq_len)
    groups.setdefault(key, []).append((r, m.num_layers * cfg.batch_size / r.chips))
  notes = []
  for group in (g for g in groups.values() if len(g) > 1):
    # per layer and sequence, in ms: measured step, matmuls, what the model charges besides
    per_unit = []
    for r, n in group:
      measured = r.modeled['step_seconds'] * r.modeled['mfu'] / r.measured_mfu
      matmul = r.modeled['matmul_at_peak_seconds']
      per_unit.append((1e3 * measured / n, 1e3 * matmul / n,
                       1e3 * (r.modeled['step_seconds'] - matmul) / n))
    room = [measured - matmul for measured, matmul, _ in per_unit]
    each = lambda values, digits=1: ' and '.join(f'{v:.{digits}f}' for v in values)
    flops = [r.program_flops_per_chip / r.model_flops_per_chip for r, _ in group]
    text = (
        f'{" and ".join(_name(r.config) for r, _ in group)} run layers of one shape: per '
        f'layer and sequence a chip runs, MaxText measured {each(u[0] for u in per_unit)} ms '
        f'(from the measured MFU), and our programs\' matmuls at the fitted rate take '
        f'{each(u[1] for u in per_unit)} ms (program/model FLOPs '
        f'{each(flops, 2)}). '
        f'That leaves {each(room)} ms for everything '
        'else (memory-bound work and exposed transfers), for which the model charges '
        f'{each(u[2] for u in per_unit)} ms.')
    if min(room) > 0 and max(room) / min(room) < apart:
      text += ' The measurements agree on that room.'
    else:
      text += (' The measurements leave the same layer very different room, and the matmul '
               'rate moves every row\'s matmul time by one factor: no value of it fits these '
               'rows together. The difference lies in what the measured runs did that our '
               'programs or the model do not (what each recomputed or overlapped, how fast its '
               'matmuls ran), not in a constant.')
    notes.append(text)
  return '**Rows of one layer shape.** ' + ' '.join(notes) if notes else ''


def alternative_note(rows: list[Row]) -> str:
  """The rows under ``step_model.ALTERNATIVE``, the other constants that fit them."""
  if not all(r.alternative for r in rows):
    return ''
  errors = ', '.join(f"{_name(r.config)} {r.alternative['error_points']:+.1f}" for r in rows)
  other = ', '.join(f'`{k}` = {v}' for k, v in step_model.ALTERNATIVE.items())
  worst = max(abs(r.alternative['error_points']) for r in rows)
  return (f'**Another fit.** These rows barely tell it from the one set: with {other} '
          f'(`step_model.ALTERNATIVE`) the errors are {errors} (worst {worst:.1f} points). '
          'The constants set lower the matmul efficiency, not the link\'s: the cost model '
          'rates rings with both, and with the link efficiency lowered it moves v4 dense_500b\'s '
          'attention weight gradients onto rings over fsdp, a plan the step model timed '
          'slower under either fit when last compiled, at links 0.79 '
          '([paper_scale.md](paper_scale.md)). '
          '[benchmarks.md](benchmarks.md) shows every modeled claim under both.')


def fit_note(fitted: dict | None, chip: step_model.Chip, worst_now: float) -> str:
  """``--fit``'s result over the rows written, and which of its fits the constants set are."""
  if not fitted:
    return ''
  each = '; '.join(
      f'{label}: ' + ', '.join(f'`{k}` = {v}' for k, v in found.items()
                                if k != 'worst_error_points')
      + f' (worst {found["worst_error_points"]:.1f} points)' for label, found in fitted.items())
  text = ('**Fit over these rows** (`--fit`: the constants with the smallest worst error; '
          f'each alone with the other at 1.0): {each}.')
  set_here = {k: getattr(chip, k) for k in step_model.FITTED}
  chosen = [label for label, found in fitted.items()
            if all(abs(found.get(k, 1.0) - v) < 1e-9 for k, v in set_here.items())]
  if chosen:
    return text + (f' The constants set are the {chosen[0]} fit; which of the fits to set, '
                   'the rows cannot say: [paper_scale.md](paper_scale.md) says why this one.')
  return text + (f' The constants set (worst {worst_now:.1f} points) are none of these: '
                 '[paper_scale.md](paper_scale.md) says why, and what setting one would change.')


def write_doc(rows: list[Row], chip: step_model.Chip, fitted: dict | None,
              held_out: dict | None) -> None:
  constants = ', '.join(f'`{k}` = {getattr(chip, k)}' for k in step_model.FITTED)
  worst = max(abs(r.modeled['error_points']) for r in rows)
  lines = ['# Calibration: the step model against measured MFU', '',
           'Generated by `python -m benchmarks.calibrate` (compiles each row for its TPU slice '
           'on this CPU machine with libtpu; no TPU is used). Modeled numbers are modeled: '
           'parallelism/step_model.py over the compiled, scheduled TPU program. Measured '
           f'numbers: {SOURCE}. MaxText\'s v5p and v5e MFU counted every (query, key) pair '
           'of causal attention (its FLOP count before its PR #1988), its v4 TFLOP/s none (6 '
           'x parameters a token); ours counts each pair once, so the measured MFU compared '
           'here is the published one over the FLOPs ours counts (its step time, our FLOP '
           'count: `aot.measured_attention` in each row, `calibrate.on_our_count`).', '',
           f'The model\'s two constants: {constants} (1.0 is the data sheet\'s rate; '
           '`python -m benchmarks.calibrate --fit` searches them over these rows); the model '
           f'is not tuned per row. Worst error: **{worst:.1f} MFU points**.', ''] + table(rows) + [
           '', f'![modeled vs measured MFU]({os.path.basename(PLOT)})', '',
           'Columns (all per chip, modeled): *matmul at fitted rate* is the program\'s matmul '
           'FLOPs at the fitted matmul rate; *memory-bound* is the rest of the compute time, '
           'instructions whose bytes over HBM bandwidth outlast their FLOPs (elementwise work, '
           'optimizer updates, windowed-einsum accumulators); *exposed comm* is time the '
           'schedule waits for transfers; '
           "*program/model FLOPs* is the program's matmul FLOPs over the model's (6 per "
           'parameter and token plus attention), above 1 from recomputation (remat).', '',
           findings(rows, worst), '', same_shape_note(rows), '', alternative_note(rows), '',
           fit_note(fitted, chip, worst), '', loo_note(held_out), '', memory_note(rows), '',
           not_reproduced_note(), '',
           'Differences between our programs and MaxText\'s that remain are listed in each '
           "config's docstring (configs/calibration/).", '']
  with open(DOC, 'w', encoding='utf-8') as f:
    f.write('\n'.join(lines))
  with open(DOC.replace('.md', '.json'), 'w', encoding='utf-8') as f:
    json.dump({'rows': [_record(r) for r in rows], 'fit': fitted,
               'leave_one_out': held_out}, f, indent=1)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 3.8))
  x = range(len(rows))
  ax.bar([i - 0.2 for i in x], [100 * r.measured_mfu for r in rows], 0.4, label='measured')
  ax.bar([i + 0.2 for i in x], [100 * r.modeled['mfu'] for r in rows], 0.4, label='modeled')
  ax.set_xticks(list(x), [_name(r.config).replace('maxtext_', '') for r in rows], rotation=30)
  ax.set_ylabel('MFU (%)')
  ax.set_title('MaxText on TPU v4, v5e and v5p: measured vs modeled')
  ax.legend()
  fig.tight_layout()
  fig.savefig(PLOT, dpi=100)


def render() -> int:
  """docs/calibration.md from the stored rows, each measured MFU read again from its config
  (the modeled figures are the stored ones: nothing compiles)."""
  with open(DOC.replace('.md', '.json'), encoding='utf-8') as f:
    stored = json.load(f)
  rows = []
  for record in stored['rows']:
    path = next(p for p in CONFIGS if _name(p) == record['config'])
    cfg = config_lib.load(os.path.join(ROOT, path), [])
    fields = {k: v for k, v in record.items() if k in Row.__dataclass_fields__}
    r = Row(**fields | {'config': path, 'hlo_path': '', 'coords': None,
                        'measured_mfu': on_our_count(cfg),
                        'published_mfu': cfg.aot.measured_mfu})
    for modeled in (r.modeled, r.alternative):
      if modeled:
        modeled['error_points'] = 100 * (modeled['mfu'] - r.measured_mfu)
    rows.append(r)
  write_doc(rows, rows[0].chip(), stored['fit'], stored.get('leave_one_out'))
  print('\n'.join(table(rows)))
  print(f'wrote {os.path.relpath(DOC)} and {os.path.relpath(PLOT)} from the stored rows',
        file=sys.stderr)
  return 0


def main(argv=None) -> int:
  args, overrides = parse_args(argv)
  if args.render:
    if (overrides or args.topology or args.fit or args.hlo_dir or args.reuse
        or args.configs != ','.join(CONFIGS)):
      print('error: --render rewrites the stored rows and takes no other option',
            file=sys.stderr)
      return 2
    return render()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # this process models; workers compile
  if args.reuse and not args.hlo_dir:
    print('error: --reuse reads the programs a run kept in --hlo_dir; give --hlo_dir DIR',
          file=sys.stderr)
    return 2
  paths = [p.strip() for p in args.configs.split(',') if p.strip()]
  if not paths:
    print(f'error: --configs {args.configs!r} names no config', file=sys.stderr)
    return 2
  writes_doc = not overrides and not args.topology and args.configs == ','.join(CONFIGS)
  if writes_doc and importlib.util.find_spec('matplotlib') is None:
    print(f'error: docs/calibration.png needs matplotlib: {install_hint("plot")}',
          file=sys.stderr)
    return 2
  with tempfile.TemporaryDirectory() as tmp:
    try:
      # every row's config and overrides, before the first compile
      checked = [check_row(path, args, overrides, args.hlo_dir or tmp) for path in paths]
      if args.hlo_dir:  # made before the first compile (its workers write there after theirs)
        aot.make_hlo_dir(args.hlo_dir, *(_name(p) for p in paths))
      rows = [(args.reuse and stored_row(c)) or compile_row(c, overrides, f'{i + 1}/{len(paths)}')
              for i, c in enumerate(checked)]
    except (ConfigError, RuntimeError) as e:  # bad input exits 2, a compiler refusal 1
      print(f'error: {e}', file=sys.stderr)
      return 2 if isinstance(e, ConfigError) else 1
    fitted = fit(rows) if args.fit or writes_doc else None
    if args.fit:
      print(f'fitted constants: {json.dumps(fitted)}', file=sys.stderr)
    held_out = leave_one_out(rows) if len(rows) > 1 else None
    for r in rows:
      r.alternative = {k: r.model(r.chip(step_model.ALTERNATIVE))[k]
                       for k in ('step_seconds', 'mfu', 'error_points')}
      r.model(r.chip())
  out = [_record(r) for r in rows]
  print(json.dumps(out, indent=1) if args.json else '\n'.join(table(rows)))
  if writes_doc:
    write_doc(rows, rows[0].chip(), fitted, held_out)
    print(f'wrote {os.path.relpath(DOC)} and {os.path.relpath(PLOT)}', file=sys.stderr)
  worst = max(abs(r.modeled['error_points']) for r in rows)
  if held_out:
    print(loo_note(held_out).replace('**', ''), file=sys.stderr)
  print(f'worst |modeled - measured| = {worst:.1f} MFU points (tolerance {args.tolerance}; '
        'modeled, not measured)', file=sys.stderr)
  return 0 if worst <= args.tolerance else 1


if __name__ == '__main__':
  sys.exit(main())
