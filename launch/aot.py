r"""Compiles the real train step for a TPU slice ahead of time, on this CPU machine.

  python -m launch.aot --config configs/dense_500b.py [--topology v4:8x8x16] \
      [--variants baseline,xla,ours] [--json] [--hlo_dir DIR] [--config.a.b=value ...]
  python -m launch.aot --config configs/dense_500b.py --tune [--plan_out plan.json]

Needs the ``tpu`` extra (``.venv/bin/python -m pip install -c constraints.txt -e
'.[tpu]'``: libtpu, the TPU compiler, which runs on CPU). For each variant, in its
own process (``LIBTPU_INIT_ARGS`` is read once per process), the train step of
``trainer/loop.py`` is compiled for the topology (default: the config's
``aot.topology``) and reported:

* per-chip memory from ``memory_analysis()``: arguments, outputs,
  temporaries, and total = arguments + outputs + temporaries - aliased,
  against the chip's usable HBM, with FITS / DOES NOT FIT;
* compile time;
* the decomposed collective einsums (the parallelism report);
* in the scheduled TPU program, every asynchronous collective-permute
  start/done pair and the compute scheduled between them;
* a modeled step time, exposed communication and MFU from the analytical model
  of parallelism/step_model.py (modeled, not measured).

With an attention kernel (``model.attention`` 'splash' or 'blockwise', or 'auto',
which picks 'splash' on a TPU), the first variant is compiled once more with
``model.attention='xla'`` (the whole ``[t, s]`` logits), reported beside it.

Variants (``hardware.name`` is set to the topology's chip for all of them). Each
compiles with the chip's default compiler flags (``hardware.xla_flags``; for v4
and v5p the asynchronous-collective flags MaxText measures with, see
parallelism/hardware.py), as a user would train:

* ``baseline``: ``collective_matmul=never``, XLA's windowed einsum off
  (``--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000``): FSDP
  collectives overlapped by the compiler, tensor-parallel ones not.
* ``xla``: ``never`` plus XLA's own windowed einsum, compiled twice (its
  default threshold, and threshold 0 with bidirectional rings); the faster
  modeled program is reported, with which one it was.
* ``ours``: the config's ``collective_matmul`` (``auto`` when it says
  ``never``), XLA's windowed einsum off: every collective-permute is ours.
* ``maxtext`` (not run by default): ``xla`` with the default threshold only,
  what MaxText runs; ``benchmarks.calibrate`` compiles it.

``--search`` sweeps layouts for the slice (mesh sizes, tokens per chip, remat) and
``--refine`` the program settings the search does not, at the config's layout
(``model.scan_unroll``, ``model.cast_in_loop``):
each prints one table and the best per variant (launch/search.py).

``--tune [--max_compiles N] [--plan_out PATH]`` tunes ours' ring schedules at the config's
layout (``search.tune``), greedily, on compiled programs: one worker plans ours under the
planner's schedules (``{}``) and under each one-field change of them (each choice of
weight-gradient rings, ``schedule.ACCUMULATORS``; each value of ``schedule.CHOICES``;
``unroll`` 1, 2 and the longest ring's steps), as ``--schedule`` sets them; candidates whose
plans would compile the same are dropped, the first N distinct ones compiled (default 6; the
rest named), each a progress line (modeled step, fit). While compiles are left, a next round
compiles each one-field change of the fastest so far, until a round finds nothing 0.5%
faster (``search.ROUND_MIN_GAIN``; two fields changed together: ``v5p.py:moe_1t``'s plan).
With ``--schedule S`` it starts from S (S and each one-field change of it) instead of the
planner's. It prints a table and writes the plan of the fastest modeled program that fits to
PATH (default ``./plan.json``, through a temporary file), with
the command that trains with it (``python -m trainer.train --config ...
--config.parallelism.plan=PATH``); ``launch.aot --variants ours
--config.parallelism.plan=PATH`` compiles that plan again. With ``--search`` it first
searches layouts for ours (the best N by the estimates, as ``--search``), then tunes at the
compiled layout with the highest modeled MFU that fits, whose overrides the printed command
carries (2N compiles). It plans anew, as ``--schedule`` does: a config's
``parallelism.plan`` is not read (a line says so). Ours only; not with ``--refine`` or
``--hlo_dir`` (exit 2).

Bad input (config, override, topology, mesh that does not match the chip count,
an ``--hlo_dir`` that cannot be a directory) exits with status 2 and one line,
before anything compiles; a failed compile with status 1.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import jax
from jax.experimental import topologies

from launch import search
from models.transformer import count_params
from parallelism import cli, hardware, hlo_text, mesh as mesh_lib, plan_file, report, schedule
from parallelism import sharding, step_model
from parallelism.ring import ADDITIONS_SCOPE, RING_SCOPE
from trainer import config as config_lib, loop, metrics, validation
from trainer.config import Config, ConfigError
from trainer.hints import install_hint
from trainer.state import abstract_model, model_for_mesh

GIB = 2 ** 30
DEFAULT_VARIANTS = 'baseline,xla,ours'
WINDOWED_EINSUM_OFF = '--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000'
WINDOWED_EINSUM_ALL = ('--xla_jf_spmd_threshold_for_windowed_einsum_mib=0 '
                       '--xla_tpu_spmd_bidirectional_windowed_einsum=true')
INSTALL_HINT = install_hint('tpu')
# Wang et al., ASPLOS 2023 (abstract), measured on TPU v4 pods.
PAPER = {'speedup': (1.14, 1.38), 'mfu_500b_1024_chips': 0.72,
         'source': 'Wang et al., ASPLOS 2023 (measured on TPU v4 pods)'}


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  collective_matmul: str | None  # None: the config's own setting
  flag_sets: tuple[str, ...]     # compiler flags on top of the chip's; the fastest is kept
  description: str


VARIANTS = {
    'baseline': Variant('baseline', 'never', (WINDOWED_EINSUM_OFF,),
                        "collective_matmul=never, XLA's windowed einsum off"),
    'xla': Variant('xla', 'never', ('', WINDOWED_EINSUM_ALL),
                   "collective_matmul=never, XLA's windowed einsum (default threshold, "
                   'or threshold 0 bidirectional: the faster)'),
    'maxtext': Variant('maxtext', 'never', ('',),
                       "collective_matmul=never, XLA's windowed einsum at its default "
                       'threshold only: what MaxText runs (benchmarks.calibrate)'),
    'ours': Variant('ours', None, (WINDOWED_EINSUM_OFF,),
                    "the config's collective_matmul (decomposed einsums), XLA's windowed "
                    'einsum off'),
}


def parse_topology(name: str) -> tuple[hardware.HardwareProfile, int]:
  """``'v4:8x8x16'`` or ``'v5e:4x4'`` -> (the chip's hardware profile, number of chips)."""
  chip, axes = topology_axes(name)
  chips = math.prod(axes)
  if chips < 1:
    raise ConfigError(f'--topology {name!r} has no chips')
  return chip, chips


def topology_axes(name: str) -> tuple[hardware.HardwareProfile, tuple[int, ...]]:
  """``'v4:8x8x16'`` -> (the chip's hardware profile, the slice's axes ``(8, 8, 16)``)."""
  m = re.fullmatch(r'(\w+):(\d+)x(\d+)(?:x(\d+))?', name or '')
  if not m or m.group(1) not in hardware.TPU_PREFIXES:
    raise ConfigError(f'--topology {name!r} is not of the form <chip>:AxBxC (or AxB) with chip '
                      f'one of {sorted(hardware.TPU_PREFIXES)} (e.g. v4:8x8x16, v5p:8x8x8)')
  return hardware.TPU_PREFIXES[m.group(1)], tuple(int(d) for d in m.groups()[1:] if d)


def parse_args(argv):
  parser = config_lib.add_help(argparse.ArgumentParser(prog='python -m launch.aot',
                                                       description=__doc__))
  parser.add_argument('--config', required=True, help='config file, path.py[:arg]')
  parser.add_argument('--topology', default=None,
                      help="TPU slice, e.g. v4:8x8x16 (default: the config's aot.topology)")
  parser.add_argument('--variants', default=None,
                      help=f'comma-separated, of {",".join(VARIANTS)} (default {DEFAULT_VARIANTS}; '
                           'with --tune: ours)')
  parser.add_argument('--json', action='store_true', help='print one JSON object')
  parser.add_argument('--hlo_dir', default=None,
                      help='also write each variant\'s scheduled TPU HLO here')
  parser.add_argument('--search', action='store_true',
                      help='sweep layouts (mesh, tokens per chip, remat) for the slice: '
                           'prune by estimated memory, compile the best (launch/search.py)')
  parser.add_argument('--refine', action='store_true',
                      help="compile the config's layout under each combination of the "
                           'program settings --search does not sweep (model.scan_unroll, '
                           'model.cast_in_loop) and name the best per variant '
                           '(launch/search.py)')
  parser.add_argument('--schedule', default='',
                      help='ring schedule settings as JSON that every ring of ours takes where '
                           "they apply, instead of the planner's (parallelism/schedule.py), "
                           'e.g. \'{"unroll": 8, "additions": "fused"}\': to compare schedules '
                           "(it plans anew: the config's parallelism.plan is not read)")
  parser.add_argument('--tune', action='store_true',
                      help="compile ours under the planner's ring schedules (or --schedule's) "
                           'and each one-field change of them, then of the fastest while '
                           '--max_compiles lasts; write the fastest modeled program that fits '
                           'to --plan_out (launch/search.py); with --search, at the best '
                           'layout the search compiles')
  parser.add_argument('--plan_out', default=plan_file.NAME,
                      help=f'with --tune: where the best plan goes (default ./{plan_file.NAME})')
  parser.add_argument('--max_compiles', type=int, default=6,
                      help='with --search: layouts to compile (default 6; 0: rank them only); '
                           'with --tune: schedules to compile in all rounds, the first '
                           "round's first (default 6); with both: N layouts, then N schedules")
  parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--out', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--flag_set', default='', help=argparse.SUPPRESS)
  parser.add_argument('--candidates', default=None, help=argparse.SUPPRESS)  # plan these only
  return parser.parse_known_args(argv)


def schedule_prefer(args) -> dict:
  """``--schedule``'s settings, checked (ConfigError in one line)."""
  try:
    prefer = json.loads(getattr(args, 'schedule', '') or '{}')
    if not isinstance(prefer, dict):
      raise ValueError('not a JSON object')
    return schedule.check_prefer(prefer)
  except ValueError as e:
    raise ConfigError(f'--schedule {getattr(args, "schedule", "")!r}: {e}') from None


def load(args, overrides) -> tuple:
  """Loads and checks the config and topology; raises ConfigError. No compiling."""
  cfg = config_lib.load(args.config, overrides)
  schedule_prefer(args)
  topology = args.topology or cfg.aot.topology
  if not topology:
    raise ConfigError(f'no --topology given and {args.config} has no aot.topology')
  chip, chips = parse_topology(topology)
  given = args.variants or ('ours' if getattr(args, 'tune', False) else DEFAULT_VARIANTS)
  variants = [v.strip() for v in given.split(',') if v.strip()]
  bad = [v for v in variants if v not in VARIANTS]
  if bad or not variants:
    raise ConfigError(f'--variants {given!r}: each must be one of {sorted(VARIANTS)}')
  if getattr(args, 'tune', False):
    check_tune(args, cfg, variants)
  try:
    info = _check(cfg, chips)
  except (KeyError, ValueError) as e:
    raise ConfigError(str(e).strip('"')) from None
  if cfg.parallelism.plan and 'ours' in variants and not plans_anew(args):
    _check_plan(cfg.parallelism.plan, _mesh_shape(cfg, chips), chip.name)
  return cfg, topology, chip, chips, variants, info


def check_tune(args, cfg: Config, variants: list[str]) -> None:
  """What ``--tune`` cannot be combined with, and where its plan goes; ConfigError in one
  line before anything compiles."""
  refused = [(args.refine, '--refine: give one of --tune and --refine'),
             (variants != ['ours'], f'--variants {args.variants!r}: --tune tunes the ours '
                                    'variant only (leave --variants out)'),
             (bool(args.hlo_dir), '--hlo_dir is not supported with --tune'),
             (args.max_compiles < 1, f'--max_compiles {args.max_compiles}: --tune compiles '
                                     "at least the planner's schedule (1)")]
  for bad, message in refused:
    if bad:
      raise ConfigError(message)
  where = os.path.dirname(os.path.abspath(args.plan_out))
  if os.path.isdir(args.plan_out) or not os.path.isdir(where) or not os.access(where, os.W_OK):
    raise ConfigError(f'--plan_out {args.plan_out}: cannot write a file there')


def _check(cfg: Config, chips: int) -> dict:
  """What trainer.train checks before compiling, against the slice's chip count."""
  cfg.validate()
  cfg = validation.resolve_attention(cfg, 'tpu')
  shape = _mesh_shape(cfg, chips)
  model = abstract_model(cfg.transformer())
  validation.check_layout(cfg, shape, model.params)
  return {'parameters': count_params(model.params),
          'mesh': ' x '.join(f'{a}={n}' for a, n in shape.items() if n > 1) or '1 chip',
          'tokens_per_step': cfg.batch_size * cfg.seq_len, 'remat': cfg.model.remat,
          'model_flops_per_step': metrics.flops_per_token(model.cfg, cfg.seq_len)
                                  * cfg.batch_size * cfg.seq_len}


def _mesh_shape(cfg: Config, chips: int) -> dict[str, int]:
  """``{axis: size}`` of the config's mesh on ``chips`` chips (ValueError where none fits)."""
  return {a: d * i for a, (d, i) in mesh_lib.mesh_sizes(cfg.mesh.sizes(), chips).items()}


def plans_anew(args) -> bool:
  """Whether ours is planned anew, the config's ``parallelism.plan`` not read: under
  ``--tune`` and ``--schedule``."""
  return bool(getattr(args, 'tune', False) or getattr(args, 'schedule', ''))


def _check_plan(path: str, shape: dict, hardware_name: str) -> None:
  """Ours' plan file, read and matched to the slice's mesh and chip before anything
  compiles; ConfigError in one line. Its layers are matched where ours plans (its worker)."""
  try:
    wrong = plan_file.mismatch(plan_file.read(path), shape, hardware_name)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if wrong:
    what, planned, here = wrong
    raise ConfigError(f'parallelism.plan={path!r} does not fit this slice: the plan is for '
                      f"{what} {planned}, this slice's is {here} "
                      "(--config.parallelism.plan='' plans anew)")


def make_hlo_dir(path: str, *subdirs: str) -> None:
  """Makes ``--hlo_dir`` before the first compile (the workers write there after theirs,
  ``subdirs`` too); raises ConfigError when it cannot be."""
  for p in (path, *(os.path.join(path, d) for d in subdirs)):
    if os.path.exists(p) and not os.path.isdir(p):
      raise ConfigError(f'--hlo_dir {path}: {p} is a file, not a directory')
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(f'--hlo_dir {path}: cannot make it ({e.strerror})') from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ConfigError(f'--hlo_dir {path}: not writable')


# ---- one variant, in its own process ---------------------------------------------


def variant_config(cfg, variant: Variant, chip: str):
  """The config ``variant`` compiles: on ``chip``, planned by the cost model (nothing runs
  here to measure). A comparator (``collective_matmul`` set: ``never``) runs every dense
  layer as the compiler does, ``layer_overrides`` included: an override naming rings would
  put ours' rings into the baseline and XLA's programs. Ours takes the config's own setting
  (``auto`` for ``never``), overrides and plan file (a comparator plans none)."""
  setting = cfg.parallelism.collective_matmul
  out = {'parallelism.tune': 'model', 'hardware.name': chip,
         'parallelism.collective_matmul': variant.collective_matmul or (
             setting if setting != 'never' else 'auto')}
  if variant.collective_matmul:
    out['parallelism.layer_overrides'] = ''
    out['parallelism.plan'] = ''
  return cfg.replace(out)


def worker(args, overrides) -> int:
  """Compiles one variant and writes its result as JSON to ``args.out``."""
  variant = VARIANTS[args.worker]
  chip_kind, _ = parse_topology(args.topology)
  cfg = variant_config(config_lib.load(args.config, overrides), variant, chip_kind.name)
  cfg = validation.resolve_attention(cfg, 'tpu')  # load() refused what cannot run there
  out = {'variant': variant.name, 'description': variant.description,
         'collective_matmul': cfg.parallelism.collective_matmul,
         'libtpu_init_args': os.environ.get('LIBTPU_INIT_ARGS', '')}
  try:
    topo = topologies.get_topology_desc(
        platform='tpu', topology_name=args.topology,
        chip_config_name=chip_kind.tpu.chip_config_name,
        chips_per_host_bounds=chip_kind.tpu.chips_per_host_bounds, num_slices=1)
    mesh = mesh_lib.make_mesh(cfg.mesh.sizes(), topo.devices)
    rules = sharding.normalize_rules(cfg.mesh.logical_axis_rules)
    saved = plan_file.read(cfg.parallelism.plan) if cfg.parallelism.plan else None
    if args.candidates is not None:  # --tune: only the plans of these schedules
      _write(args.out, out | {'plans': [
          plan_of(model_for_mesh(cfg, mesh, rules, saved, prefer=prefer), mesh, cfg)
          for prefer in json.loads(args.candidates)]})
      return 0
    model = model_for_mesh(cfg, mesh, rules, saved, prefer=schedule_prefer(args))
    program = loop.build(cfg, model, mesh, rules)
  except (ValueError, RuntimeError) as e:  # a topology the compiler refuses, a bad layout
    _write(args.out, out | {'error': str(e).splitlines()[0], 'input_error': True})
    return 0
  out['plan'] = plan_of(model, mesh, cfg)  # what --tune writes for the one it picks
  start = time.perf_counter()
  lowered = program.train_step.lower(program.abstract_state,
                                     program.abstract_batch(cfg.batch_size, cfg.seq_len))
  out['layers'] = report.rows(program.ops.plan)
  out['planned_kernels'] = report.kernel_rings(program.ops.plan)
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    if 'RESOURCE_EXHAUSTED' not in str(e) and 'memory' not in str(e).lower():
      raise
    message = ' '.join(str(e).split())
    usable = re.search(r'available HBM \(([\d.]+)G\)', message)  # the compiler's own figure
    out['compile_seconds'] = time.perf_counter() - start
    out['memory'] = {'fits': False, 'compiler_message': message[:2000],
                     'usable_bytes': float(usable.group(1)) * GIB if usable
                                     else chip_kind.usable_hbm_bytes}
    _write(args.out, out)
    return 0
  out['compile_seconds'] = time.perf_counter() - start
  out['memory'] = memory(compiled.memory_analysis(), chip_kind.usable_hbm_bytes)
  text = compiled.as_text()
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
    with open(os.path.join(args.hlo_dir, f'{variant.name}{args.flag_set or ""}.hlo.txt'), 'w',
              encoding='utf-8') as f:
      f.write(text)
  chip = step_model.Chip.from_profile(chip_kind.name)
  if cfg.hardware.peak_flops > 0:
    chip = dataclasses.replace(chip, peak_flops=cfg.hardware.peak_flops)
  out['coords'] = [tuple(d.coords) for d in mesh.devices.flat]  # by partition id
  module = hlo_text.parse(text)
  result = step_model.analyze(module, chip, out['coords'])
  other = step_model.analyze(module, dataclasses.replace(chip, **step_model.ALTERNATIVE),
                             out['coords'])
  out['model'] = result.as_dict() | {'chip': dataclasses.asdict(chip), 'alternative': {
      'constants': step_model.ALTERNATIVE, 'step_seconds': other.step_seconds,
      'compute_seconds': other.compute_seconds,
      'exposed_comm_seconds': other.exposed_comm_seconds}, 'band': band(module, chip,
                                                                          out['coords'])}
  out['jax'] = jax.__version__
  _write(args.out, out)
  return 0


def plan_of(model, mesh, cfg: Config) -> dict:
  """The model's layer plan as plan.json holds it (as a training run writes it,
  trainer/loop.py): ``parallelism.plan=PATH`` runs it again."""
  return plan_file.to_json(model.ops.plan, mesh.shape, cfg.hardware.name)


def band(module, chip: step_model.Chip, coords) -> list[dict]:
  """The program modeled under each of ``step_model.band_chips``: its setting and times."""
  rows = []
  for setting, c in step_model.band_chips(chip):
    r = step_model.analyze(module, c, coords)
    rows.append({'setting': setting, 'step_seconds': r.step_seconds,
                 'compute_seconds': r.compute_seconds,
                 'exposed_comm_seconds': r.exposed_comm_seconds})
  return rows


def memory(stats, usable: float) -> dict:
  """Per-chip bytes; total = arguments + outputs + temporaries - aliased."""
  m = {'arguments': stats.argument_size_in_bytes, 'outputs': stats.output_size_in_bytes,
       'temporaries': stats.temp_size_in_bytes, 'aliased': stats.alias_size_in_bytes,
       'generated_code': stats.generated_code_size_in_bytes}
  m['total'] = m['arguments'] + m['outputs'] + m['temporaries'] - m['aliased']
  return m | {'usable_bytes': usable, 'fits': m['total'] <= usable}


def _write(path: str, obj: dict) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(obj, f)


def run_variant(args, overrides, name: str, topology: str, chip_flags: str) -> dict:
  """Runs ``worker`` for each of a variant's flag sets, each in a fresh process
  (``LIBTPU_INIT_ARGS`` is read once per process): the chip's flags, the
  user's ``LIBTPU_INIT_ARGS``, then the variant's. Keeps the fastest modeled
  program that fits (or the first, when none does)."""
  results = []
  for k, extra in enumerate(VARIANTS[name].flag_sets):
    more = ['--schedule', getattr(args, 'schedule', '') or '{}']
    if args.hlo_dir:
      more += ['--hlo_dir', args.hlo_dir] + (['--flag_set', f'.{k}'] if k else [])
    r = run_worker(args, overrides, name, topology, (chip_flags, extra), more)
    if 'error' in r:
      return r
    results.append(r | {'flag_set': extra or 'default threshold'})
  ranked = sorted(results, key=lambda r: (not r['memory']['fits'],
                                          r.get('model', {}).get('step_seconds', math.inf)))
  return ranked[0] | {'flag_sets_tried': len(results)}


def run_worker(args, overrides, name: str, topology: str, flags: tuple[str, str],
               more: list) -> dict:
  """``worker`` for variant ``name`` in a fresh process with the worker arguments
  ``more``, under the compiler flags ``(chip's, variant's)`` with the user's
  ``LIBTPU_INIT_ARGS`` between them: its result, or ``{'error': ...}``."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}  # TPU, not CPU
  chip_flags, extra = flags
  env['LIBTPU_INIT_ARGS'] = ' '.join(filter(None, [chip_flags, env.get('LIBTPU_INIT_ARGS'),
                                                   extra]))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [root, env.get('PYTHONPATH')]))
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'result.json')
    cmd = [sys.executable, '-m', 'launch.aot', '--config', args.config, '--topology',
           topology, '--worker', name, '--out', out] + list(more) + list(overrides)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode or not os.path.exists(out):
      return {'variant': name, 'error': f'compile failed (exit {proc.returncode}): '
                                        f'{error_line(proc.stderr)}'}
    with open(out, encoding='utf-8') as f:
      return json.load(f)


def error_line(stderr: str) -> str:
  """The line of a failed worker's stderr that names its error: the last exception line
  (JAX ends a traceback with a note on the frames it hid), else the last line."""
  lines = [l.strip() for l in stderr.splitlines() if l.strip()]
  errors = [l for l in lines if re.match(r'[\w.]+(Error|Exception)\b', l)]
  return (errors or lines or ['(no output)'])[-1]


# ---- the summary ------------------------------------------------------------------


def summarize(cfg, config_path: str, topology: str, chip: hardware.HardwareProfile, chips: int,
              info: dict, results: dict) -> dict:
  """One JSON-able object: memory, layers, permute pairs, modeled times per variant."""
  peak = cfg.hardware.peak_flops or chip.peak_flops
  out = {'config': config_path, 'topology': topology, 'chips': chips,
         'chip': chip.name, **info, 'variants': {}, 'modeled': {}, 'paper': PAPER}
  for name, r in results.items():
    v = {k: r.get(k) for k in ('description', 'collective_matmul', 'libtpu_init_args',
                               'flag_set', 'compile_seconds', 'memory')}
    if r['memory'] and 'total' in r['memory']:
      v['memory']['fit'] = 'FITS' if r['memory']['fits'] else 'DOES NOT FIT'
    elif r['memory']:
      v['memory']['fit'] = 'DOES NOT FIT'
    layers = r.get('layers', [])
    v['decomposed_layers'] = [l['path'] for l in layers if report.runs_a_ring(l)]
    v['layers'] = layers
    model = r.get('model')
    if model:
      pairs = [p | {'layer': _layer(p['op_name'])} for p in model['pairs']
               if p['kind'] == 'collective-permute']
      v['permute_pairs'] = {
          'count': len(pairs),
          'from_collective_einsum': sum(RING_SCOPE in p['op_name'] for p in pairs),
          'with_einsum_between': sum(bool(p['einsums_between']) for p in pairs),
          'routes': routes(pairs), 'pairs': pairs}
      step = model['step_seconds']
      kernels = by_ring(model.get('kernels_by_op', {}))
      out['modeled'][name] = {
          'step_seconds': step, 'compute_seconds': model['compute_seconds'],
          'compute_terms': model['compute_terms'],
          'communication_seconds': model['comm_seconds'],
          'exposed_communication_seconds': model['exposed_comm_seconds'],
          'exposed_dma_seconds': model['exposed_dma_seconds'],
          'program_flops_per_chip': model['flops'],
          'mfu': info['model_flops_per_step'] / (chips * peak * step) if step else None,
          'collectives': model['collectives'], 'rings': ring_terms(pairs),
          'exposed_off_rings': exposed_off_rings(model['exposed_by']),
          'costliest_non_matmul': costliest_non_matmul(model['non_matmul_by_op']),
          'additions_by_ring': additions_by_ring(model['non_matmul_by_op']),
          'kernels_by_ring': kernels,
          # the plan's rings that run the kernel: the same rings, or a warning says which
          'planned_kernels': r.get('planned_kernels', []),
          'warnings': model['warnings'] + _kernel_mismatch(r.get('planned_kernels', []),
                                                           kernels)}
      if 'alternative' in model:  # the same program under step_model.ALTERNATIVE
        other = model['alternative']
        out['modeled'][name]['alternative'] = other | {
            'mfu': info['model_flops_per_step'] / (chips * peak * other['step_seconds'])}
      if 'band' in model:  # the same program under step_model.band_chips
        steps = [b['step_seconds'] for b in model['band']]
        out['modeled'][name]['band'] = {
            'settings': [b['setting'] for b in model['band']], 'step_seconds': steps,
            'mfu': step_model.band_of(info['model_flops_per_step'] / (chips * peak * t)
                                      for t in steps)}
    out['variants'][name] = v
  base = out['modeled'].get('baseline')
  for name, m in out['modeled'].items():
    m['speedup_vs_baseline'] = base['step_seconds'] / m['step_seconds'] if base else None
  if 'xla' in out['modeled'] and 'ours' in out['modeled']:
    out['modeled']['ours']['speedup_vs_xla'] = (out['modeled']['xla']['step_seconds']
                                                / out['modeled']['ours']['step_seconds'])
  ratio_bands(out['modeled'])
  main = 'ours' if 'ours' in out['variants'] else next(iter(out['variants']))
  out['fit'] = out['variants'][main]['memory']['fit']
  return out


def ratio_bands(modeled: dict) -> None:
  """Ours' speedups as bands: against the baseline, xla and the faster of the two, each
  ratio taken under one setting of the model for both programs (``band``)."""
  ours = modeled.get('ours', {}).get('band')
  if not ours:
    return
  others = {n: modeled[n]['band'] for n in ('baseline', 'xla') if 'band' in modeled.get(n, {})}
  for name, b in others.items():
    if b['settings'] != ours['settings']:
      raise ValueError(f'the {name} program was modeled under other settings than ours')
  ratios = {n: [t / o for t, o in zip(b['step_seconds'], ours['step_seconds'])]
            for n, b in others.items()}
  for name, values in ratios.items():
    ours[f'speedup_vs_{name}'] = step_model.band_of(values)
  if ratios:
    ours['speedup_vs_best'] = step_model.band_of(map(min, zip(*ratios.values())))


def band_lines(modeled: dict) -> list[str]:
  """The text report's bands: each variant's MFU and ours' speedups, min / median / max."""
  fmt = step_model.band_range
  rows = [f'  {name} MFU {fmt(m["band"]["mfu"], ".1%")}' for name, m in modeled.items()
          if 'mfu' in m.get('band', {})]
  ours = modeled.get('ours', {}).get('band', {})
  rows += [f'  ours / {over} {fmt(ours[key], ".3f")}' for over, key in (
      ('baseline', 'speedup_vs_baseline'), ('xla', 'speedup_vs_xla'),
      ('the faster of the two', 'speedup_vs_best')) if key in ours]
  if not rows:
    return []
  return ['', f"modeled band, min / median / max over the model's plausible settings "
              f'({step_model.band_settings()}; step_model.band_chips):'] + rows


def ring_terms(pairs: list[dict]) -> dict:
  """Per layer (and pass), its rings' collective-permutes, in modeled seconds per step:
  their transfers, the compute scheduled between their starts and dones, and the time the
  chip waited for them (exposed). A bidirectional ring's two permutes of a round each
  count the round's transfer and compute (they run at once): their ratio stays true. Most
  exposed first."""
  out = {}
  for p in pairs:
    if RING_SCOPE not in p['op_name']:
      continue
    row = out.setdefault(p['layer'], dict.fromkeys(('transfer', 'compute_between',
                                                    'exposed'), 0.0))
    times = p.get('executions', 0.0) / 1e6
    row['transfer'] += times * p['transfer_us']
    row['compute_between'] += times * p['compute_between_us']
    row['exposed'] += times * p['exposed_us']
  return dict(sorted(out.items(), key=lambda kv: -kv[1]['exposed']))


def routes(pairs: list[dict]) -> dict:
  """Collective-permutes a step runs, by the most pairs one link carries and the longest
  pair's hops on the slice's torus (``step_model.route``): ``'load L, H hops' -> count``.
  The model prices each as one hop on a link of its own; this says where that holds."""
  out = collections.Counter()
  for p in pairs:
    out[f"load {p.get('link_load', 1)}, {p.get('hops', 1)} hops"] += p.get('executions', 0.0)
  return dict(sorted(out.items()))


def exposed_off_rings(exposed_by: dict, top: int = 8) -> dict:
  """The exposed communication besides the rings' collective-permutes (``rings``), in
  modeled seconds per step, by collective and where it comes from (the layer and pass, the
  op otherwise, or the compiler's own where it has no op_name): the ``top`` most."""
  out = {}
  for key, seconds in exposed_by.items():
    kind, op_name = step_model.split_exposed_key(key)
    if kind.startswith('collective-permute') and RING_SCOPE in op_name:
      continue
    label = f"{kind}: {_origin(op_name, op_name.rsplit('/', 1)[-1])}"
    out[label] = out.get(label, 0.0) + seconds
  return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top])


def costliest_non_matmul(by_op: dict, top: int = 10) -> dict:
  """The step's work outside matmuls (additions, copies, slices, elementwise passes), in
  modeled seconds per step, by where it comes from: the dense layer and pass (a decomposed
  einsum's own instructions marked ``ring``) and the operation (the op_name's last part,
  with the ``jit(...)`` it sits in), or, for the compiler's own instructions (no op_name),
  their opcode and shape with its layout (``step_model.unnamed_key``); the ``top`` most."""
  out = {}
  for op_name, seconds in by_op.items():
    parts = op_name.split('/')
    what = '/'.join(parts[-2:]) if len(parts) > 2 and parts[-2].startswith('jit(') else parts[-1]
    where = _layer(op_name)
    if op_name.startswith(step_model.UNNAMED):  # already says what it is
      label = op_name
    elif where == '-':
      label = _origin(op_name, what)
    else:
      label = f"{where}{' ring' if RING_SCOPE in op_name else ''}: {what}"
    out[label] = out.get(label, 0.0) + seconds
  return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top])


def additions_by_ring(by_op: dict) -> dict:
  """The compute term ``ring: partial-sum additions`` split by ring, in modeled seconds per
  step: each decomposed einsum's additions of partial sums that run as passes of their own
  (those the compiler fused into an einsum count as its matmul), keyed by the einsum's name
  (the scope just outside the ring's: ``blocks.*.1.moe.gate``, not the ``moe.exchange``
  around it), pass, equation, collective and direction; most first. They sum to the term."""
  return by_ring({k: s for k, s in by_op.items() if f'/{ADDITIONS_SCOPE}/' in k})


def _kernel_mismatch(planned: list, found: dict) -> list[str]:
  """A warning where the rings the plan runs as kernels are not those the compiled program
  runs kernels in (``kernels_by_ring``), naming the first of each side's extras."""
  extra, missing = sorted(set(found) - set(planned)), sorted(set(planned) - set(found))
  if not extra and not missing:
    return []
  return [f'kernels: the plan and the program differ (only in the program: '
          f"{extra[0] if extra else '-'}; only in the plan: {missing[0] if missing else '-'})"]


def by_ring(by_op: dict) -> dict:
  """Modeled seconds per step of the instructions ``by_op`` names (op_name -> seconds)
  that belong to decomposed einsums, keyed as ``additions_by_ring``'s; most first. With
  the step model's ``kernels_by_op``: the rings whose rounds run as Pallas kernels (their
  schedules' additions 'kernel', parallelism/pair_sums.py), and their time."""
  out = {}
  for op_name, seconds in by_op.items():
    m = re.search(rf'([^/]+)/{RING_SCOPE}/(\w+)/(\w+)/([^/]+)/', op_name)
    if not m:
      continue
    name, kind, direction, equation = m.groups()
    name = re.sub(r'^(?:\w+\()+|\)+$', '', name)  # transpose(jvp(unembed)) -> unembed
    label = report.ring_label(name, 'transpose(' in op_name, equation, kind, direction)
    out[label] = out.get(label, 0.0) + seconds
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _origin(op_name: str, what: str) -> str:
  """Where an instruction comes from: its dense layer (and pass), else ``what`` it does
  (and the pass), else the compiler's own (no op_name)."""
  where = _layer(op_name)
  if where != '-':
    return where
  return what + (' (bwd)' if 'transpose(' in op_name else '') if op_name else \
      f'{step_model.UNNAMED}(no op_name)'


def _layer(op_name: str) -> str:
  """The dense layer (and pass) an instruction belongs to, from its op_name."""
  m = re.search(r'(blocks\.\*\.[\w.]+?|unembed)(/|\)|$)', op_name)
  name = m.group(1) if m else '-'
  return name + (' (bwd)' if m and 'transpose(' in op_name else '')


def _gib(x: float) -> str:
  return f'{x / GIB:.2f}'


def text_report(s: dict, max_pairs: int = 12) -> str:
  lines = [f"{s['config']} on TPU {s['topology']} ({s['chips']} chips), mesh {s['mesh']}: "
           f"{s['parameters']:,} parameters, {s['tokens_per_step']:,} tokens per step",
           '', 'memory per chip (GiB): total = arguments + outputs + temporaries - aliased']
  w = max(8, *(len(name) for name in s['variants']))
  for name, v in s['variants'].items():
    m = v['memory']
    if 'total' in m:
      mem = (f"{_gib(m['arguments'])} + {_gib(m['outputs'])} + {_gib(m['temporaries'])} - "
             f"{_gib(m['aliased'])} = {_gib(m['total'])} of {_gib(m['usable_bytes'])} usable")
    else:
      mem = f"compiler: {m['compiler_message'][:200]}"
    lines.append(f"  {name:{w}s} {mem}: {m['fit']}  (compiled in {v['compile_seconds']:.0f} s; "
                 f"{v['description']})")
  for name, v in s['variants'].items():
    if v['decomposed_layers']:
      lines += ['', f"{name}: decomposed collective einsums, {len(v['decomposed_layers'])} of "
                    f"{len(v['layers'])} dense layers (parallelism report, per-step times "
                    'modeled):', report.table(v['layers'])]
  for name, v in s['variants'].items():
    pp = v.get('permute_pairs')
    if not pp:
      continue
    lines += ['', f"{name}: {pp['count']} async collective-permute start/done pairs in the "
                  f"scheduled TPU program ({pp['from_collective_einsum']} from collective_einsum), "
                  f"{pp['with_einsum_between']} with an einsum scheduled between start and done "
                  '(times modeled); per step by link load and hops: '
                  + ', '.join(f'{k}: {n:.0f}' for k, n in pp.get('routes', {}).items())]
    head = ('layer', 'start', 'done', 'runs/step', 'transfer us', 'compute between us',
            'exposed us', 'einsums between')
    rows = [head] + [(_layer(p['op_name']), p['start'], p['done'], f"{p['executions']:.0f}",
                      f"{p['transfer_us']:.1f}",
                      f"{p['compute_between_us']:.1f}", f"{p['exposed_us']:.1f}",
                      ', '.join(p['einsums_between'][:3]) or '-')
                     for p in pp['pairs'][:max_pairs]]
    lines += ['  ' + row for row in search.aligned(rows)]
    if len(pp['pairs']) > max_pairs:
      lines.append(f"  ... {len(pp['pairs']) - max_pairs} more (--json lists all)")
  if s['modeled']:
    lines += ['', 'modeled step time (analytical model over the compiled TPU schedule, '
                  'parallelism/step_model.py; modeled, not measured):',
              f"  {'variant':{w}s} {'step s':>8s} {'compute s':>9s} {'comm s':>8s} "
              f"{'exposed comm s':>14s} {'modeled MFU':>11s} {'modeled speedup':>15s}"]
    for name, m in s['modeled'].items():
      speed = f"{m['speedup_vs_baseline']:.3f}x" if m['speedup_vs_baseline'] else '-'
      lines.append(f"  {name:{w}s} {m['step_seconds']:8.3f} {m['compute_seconds']:9.3f} "
                   f"{m['communication_seconds']:8.3f} "
                   f"{m['exposed_communication_seconds']:14.3f} {m['mfu']:11.1%} {speed:>15s}")
    lines.append('  (modeled speedup = baseline modeled step time / variant modeled step time)')
    lines += band_lines(s['modeled'])
    lines += ['', 'modeled compute by term (s; ring: instructions of decomposed einsums):']
    lines += [f"  {name:{w}s} " + ', '.join(f'{term} {sec:.3f}' for term, sec in
                                         m.get('compute_terms', {}).items() if sec)
              for name, m in s['modeled'].items()]
    for key, title in (
        ('costliest_non_matmul', "costliest non-matmul work (s; by layer and operation, ring: "
                                 "a decomposed einsum's own):"),
        ('additions_by_ring', "rings' additions of partial sums, by einsum (s; those run as "
                              "passes of their own):"),
        ('kernels_by_ring', "rings whose rounds run as Pallas kernels, by einsum (s; "
                            "parallelism.ring_additions='kernel'):"),
        ('exposed_off_rings', "modeled exposed communication off the rings (s; the collectives "
                              "the chip waited for, besides the rings' collective-permutes, by "
                              "where they come from):")):
      lines += ['', title] + [f"  {name:{w}s} " + ('; '.join(
          f'{k} {sec:.3f}' for k, sec in list(m.get(key, {}).items())[:4]) or '-')
                              for name, m in s['modeled'].items()]
    lines.append(f'  step model calibration: {step_model.calibration_summary()} '
                 '(docs/calibration.md)')
  p = s['paper']
  lines.append(f"paper ({p['source']}): {p['speedup'][0]}x-{p['speedup'][1]}x throughput, "
               f"{p['mfu_500b_1024_chips']:.0%} of peak FLOPS for 500B on 1024 chips")
  lines.append(f"memory fit ({'ours' if 'ours' in s['variants'] else 'first variant'}): {s['fit']}")
  return '\n'.join(lines)


def main(argv=None) -> int:
  args, overrides = parse_args(argv)
  if args.worker:
    return worker(args, overrides)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # this process only checks; workers compile
  try:
    cfg, topology, chip, chips, variants, info = load(args, overrides)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if args.search and args.refine:
    print('error: --search and --refine: give one (refine the layout the search picks by '
          'passing it as overrides)', file=sys.stderr)
    return 2
  if args.search and args.max_compiles < 0:
    print(f'error: --max_compiles {args.max_compiles} is negative', file=sys.stderr)
    return 2
  ranking_only = args.search and args.max_compiles == 0  # compiles nothing
  if importlib.util.find_spec('libtpu') is None and not ranking_only:
    print(f'error: libtpu (the TPU compiler) is not installed: {INSTALL_HINT}', file=sys.stderr)
    return 2
  if args.hlo_dir and not ranking_only:  # last: made only when something will compile
    try:
      make_hlo_dir(args.hlo_dir, *(['attention_xla'] if cfg.model.attention != 'xla' else []))
    except ConfigError as e:
      print(f'error: {e}', file=sys.stderr)
      return 2
  def compile_layout(extra, only=variants):
    cfg_l, _, _, _, _, info_l = load(args, overrides + extra)
    results = compile_variants(args, overrides + extra, cfg_l, topology, chip, only)
    return None if isinstance(results, int) else summarize(
        cfg_l, args.config, topology, chip, chips, info_l, results)
  if plans_anew(args) and cfg.parallelism.plan:
    print(f"{'--tune' if args.tune else '--schedule'} plans anew: "
          f'parallelism.plan={cfg.parallelism.plan!r} is not read', file=sys.stderr)
    overrides = overrides + [search.PLAN_ANEW]
    cfg = cfg.replace({'parallelism.plan': ''})
  if args.tune and args.search:
    return tune_layout(args, overrides, cfg, topology, chip, compile_layout)
  if args.tune:
    return tune(args, overrides, cfg, topology, chip, chips, info)
  if args.search or args.refine:
    if args.refine:
      return search.refine(cfg, variants, compile_layout)
    return search.run(args, overrides, cfg, topology, chip, topology_axes(topology)[1],
                      variants, compile_layout)
  results = compile_variants(args, overrides, cfg, topology, chip, variants)
  if isinstance(results, int):
    return results
  if cfg.model.attention != 'xla':  # the attention kernel's memory next to the plain one's
    print(f"then {variants[0]} with model.attention='xla' (instead of "
          f"{cfg.model.attention!r}), to compare memory:", file=sys.stderr, flush=True)
    hlo_dir = args.hlo_dir and os.path.join(args.hlo_dir, 'attention_xla')
    plain = compile_variants(argparse.Namespace(**{**vars(args), 'hlo_dir': hlo_dir}),
                             overrides + ['--config.model.attention=xla'], cfg, topology, chip,
                             variants[:1])
    if isinstance(plain, int):
      return plain
    results[f"{variants[0]}, attention=xla"] = plain[variants[0]]
  s = summarize(cfg, args.config, topology, chip, chips, info, results)
  print(json.dumps(s, indent=1) if args.json else text_report(s))
  return 0


def tune_layout(args, overrides, cfg, topology, chip, compile_layout) -> int:
  """``--tune --search``: the layout search for ours (``search.best_layout``, the first
  ``--max_compiles`` layouts), then ``tune`` at the best layout that fits, its overrides
  added to the command that trains with the plan. Exit status 1 where no layout fits."""
  layout = search.best_layout(args.max_compiles, cfg, topology, chip,
                              topology_axes(topology)[1], compile_layout)
  if layout is None:
    print(f'{args.plan_out} not written: ours fits at no compiled layout', file=sys.stderr)
    return 1
  overrides = overrides + layout.overrides
  cfg, topology, chip, chips, _, info = load(args, overrides)
  return tune(args, overrides, cfg, topology, chip, chips, info, where=str(layout))


def tune(args, overrides, cfg, topology, chip, chips, info,
         where: str = "the config's layout") -> int:
  """``--tune``: plans every candidate schedule of ``search.schedule_grid`` in one worker,
  compiles ours under each distinct plan (``search.tune``) and writes the best plan."""
  flags = (hardware.compiler_flags(chip, cfg.hardware.xla_flags), VARIANTS['ours'].flag_sets[0])

  def plan_all(prefers):
    r = run_worker(args, overrides, 'ours', topology, flags,
                   ['--candidates', json.dumps(prefers)])
    return r.get('error') or r['plans']

  def compile_one(prefer):
    a = argparse.Namespace(**{**vars(args), 'schedule': json.dumps(prefer)})
    r = run_variant(a, overrides, 'ours', topology, flags[0])
    if 'error' in r:
      return r['error']
    return summarize(cfg, args.config, topology, chip, chips, info, {'ours': r}) | {
        'plan': r['plan']}

  def write_plan(plan):
    plan_file.write(args.plan_out, plan)
    kept = [o for o in overrides if not o.startswith(search.PLAN_ANEW)]
    return ' '.join(shlex.quote(a) for a in (
        'python', '-m', 'trainer.train', '--config', args.config, *kept,
        f'--config.parallelism.plan={args.plan_out}'))

  shape = {a: d * i for a, (d, i) in mesh_lib.mesh_sizes(cfg.mesh.sizes(), chips).items()}
  return search.tune(shape, args.max_compiles, plan_all, compile_one, write_plan,
                     args.plan_out, where, start=schedule_prefer(args))


def compile_variants(args, overrides, cfg, topology, chip, variants) -> dict | int:
  """Compiles each variant in its own process, with progress: the results, or the
  exit status after a failure (2: the compiler refused the input, 1: it failed)."""
  results = {}
  for i, name in enumerate(variants):
    print(f'[{i + 1}/{len(variants)}] {name}: compiling for {topology} in a subprocess '
          f'({VARIANTS[name].description})...', file=sys.stderr, flush=True)
    start = time.perf_counter()
    r = run_variant(args, overrides, name, topology,
                    hardware.compiler_flags(chip, cfg.hardware.xla_flags))
    if 'error' in r:
      print(f"error: {name}: {r['error']}", file=sys.stderr)
      return 2 if r.get('input_error') else 1
    m = r['memory']
    step = r.get('model', {}).get('step_seconds')
    print(f"[{i + 1}/{len(variants)}] {name}: done in {time.perf_counter() - start:.0f} s; "
          + (f"{_gib(m['total'])} GiB per chip" if 'total' in m else 'out of memory')
          + (f'; modeled step {step:.3f} s' if step else ''), file=sys.stderr, flush=True)
    results[name] = r
  return results


if __name__ == '__main__':
  cli.run(main)
