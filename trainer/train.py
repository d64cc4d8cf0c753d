r"""Trains a Transformer LM from a config file.

  python -m trainer.train --config configs/default.py [--workdir DIR] [--verbose] \
      [--config.a.b=value ...]

Outputs in the workdir (default ``runs/<config name>``): ``config.json`` (the
resolved config), ``metrics.jsonl`` (one JSON object per logged step and per
eval), TensorBoard event files in ``tb/`` and ``parallelism_report.json`` (what
the parallelism layer decided for every dense layer). Bad input exits with status 2
and a one-line message before anything is compiled or written; so does a workdir
another run is using (it holds ``ringtrain.lock`` there, see lock_workdir). A
corrupt checkpoint exits with status 1, naming it; so does a failed save, and a
full disk or I/O error (one line; ``--verbose`` adds the traceback). An earlier
run's outputs are replaced only once this run has compiled and passed its first
steps. SIGTERM, SIGINT and SIGHUP save and exit 128 + the signal's number
(trainer/runtime.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import traceback
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from parallelism import cli, mesh as mesh_lib, plan_file, sharding
from trainer import checkpoint, config as config_lib, data, loop, pipeline, runtime, validation
from trainer import metrics as metrics_lib, tokenizer as tokenizer_lib
from trainer.config import Config, ConfigError
from trainer.state import AbstractModel, model_for_mesh

LOCK_FILE = 'ringtrain.lock'  # in the workdir while a run uses it (lock_workdir)


@dataclasses.dataclass
class Run:
  """Everything validated before compilation starts."""
  cfg: Config
  workdir: str
  mesh: Any
  rules: sharding.Rules
  model: AbstractModel   # built abstractly once, with the run's ops
  corpus: Any
  resume_step: int | None = None  # the newest checkpoint in the workdir, if any

  @property
  def model_cfg(self):
    return self.model.cfg


def parse_args(argv):
  parser = config_lib.add_help(argparse.ArgumentParser(prog='python -m trainer.train',
                                                       description=__doc__))
  parser.add_argument('--config', required=True, help='config file, path.py[:arg]')
  parser.add_argument('--workdir', default=None, help='output directory')
  parser.add_argument('--verbose', action='store_true',
                      help='print the traceback of an I/O error, and the libraries\' error logs')
  return parser.parse_known_args(argv)


def prepare(args, overrides) -> Run:
  """Loads and checks everything a run needs; raises ConfigError on bad input."""
  workdir = args.workdir or os.path.join('runs', os.path.splitext(
      os.path.basename(args.config.partition(':')[0]))[0])
  return prepare_loaded(config_lib.load(args.config, overrides), workdir)


def prepare_loaded(cfg: Config, workdir: str) -> Run:
  """prepare() for a config already loaded (trainer/evaluate.py)."""
  return _validated(_prepare, cfg, workdir)


def _validated(fn, *args):
  """``fn(*args)``, its ValueErrors (bad input) raised as ConfigError.

  Validators raise ValueError (and CheckpointError); a corrupt checkpoint
  (trainer.checkpoint.CorruptCheckpoint, exit status 1) is no bad input and passes.
  """
  try:
    return fn(*args)
  except (KeyError, ValueError) as e:
    if hasattr(e, 'exit_status'):
      raise
    raise ConfigError(str(e).strip('"')) from None


def _prepare(cfg: Config, workdir: str) -> Run:
  _check_workdir(workdir)
  cfg.validate()
  profile = runtime.start(cfg)
  cfg = validation.resolve_attention(cfg.replace({'hardware.name': profile.name}),
                                     profile.platform)
  mesh = mesh_lib.make_mesh(cfg.mesh.sizes())
  rules = sharding.normalize_rules(cfg.mesh.logical_axis_rules)
  model = _planned(cfg, workdir, mesh, rules)
  corpus = data.load(cfg.data, model.cfg.vocab_size, cfg.seed)
  data.check_lengths(corpus, cfg.seq_len, cfg.batch_size, cfg.eval_steps)
  run = Run(cfg, workdir, mesh, rules, model, corpus)
  run.resume_step = _check_checkpoints(run)
  return run


def _planned(cfg: Config, workdir: str, mesh, rules) -> AbstractModel:
  """The run's model (``model_for_mesh``, which checks the layout first) with the plan it
  runs: ``parallelism.plan``'s, refused where it does not match; a resume's workdir plan.json
  where it matches, else a new plan (resuming on another mesh; another model is refused by
  the checkpoint check, naming the setting that differs)."""
  path = _plan_path(cfg, workdir)
  saved = plan_file.read(path) if path else None
  try:
    model = model_for_mesh(cfg, mesh, rules, saved)
  except plan_file.PlanMismatch as e:
    if cfg.parallelism.plan:  # a paper config's tuned plan, say, under another layout
      raise plan_file.PlanMismatch(f'parallelism.plan={cfg.parallelism.plan!r} does not fit '
                                   f"this run: {e} (--config.parallelism.plan='' plans "
                                   'anew)') from None
    if jax.process_index() == 0:
      print(f'plan: {path} does not fit this run ({e}); planning anew')
    return model_for_mesh(cfg, mesh, rules)
  if saved is not None and jax.process_index() == 0:  # parallelism.tune has nothing to do
    print(f'plan: runs {path} as saved (no layer planned or measured)')
  return model


def _plan_path(cfg: Config, workdir: str) -> str:
  """The plan file this run runs (``parallelism/plan_file.py``): ``parallelism.plan``, else
  the workdir's plan.json where the run resumes, else '' (it plans)."""
  path = cfg.parallelism.plan
  if not path and checkpoint.complete_steps(checkpoint.directory_of(workdir)):
    path = os.path.join(workdir, plan_file.NAME)
    path = path if os.path.exists(path) else ''
  return path


def _check_checkpoints(run: Run) -> int | None:
  """Refuses, before compiling, a resume or an init_from that cannot work.

  Returns the step this run resumes from, if the workdir has checkpoints: the
  newest whose metadata reads (older ones only under checkpoint.on_corrupt=previous;
  the restore sets the others aside).
  """
  cfg, workdir = run.cfg, run.workdir
  directory = checkpoint.directory_of(workdir)
  steps = checkpoint.complete_steps(directory)
  if steps:  # this run resumes: it must be the same model and data order
    meta, step = checkpoint.newest_good(steps, cfg.checkpoint.on_corrupt,
                                        lambda s: checkpoint.read_meta(directory, s))
    diff = [f'model.{k}: {meta["model"].get(k)!r} in the checkpoint, {v!r} now'
            for k, v in dataclasses.asdict(run.model_cfg).items()
            if meta['model'].get(k) != v and k not in run.model_cfg.EXECUTION_ONLY]
    if meta.get('seed') != cfg.seed:
      diff.append(f'seed: {meta.get("seed")} in the checkpoint, {cfg.seed} now')
    diff += _data_differences(meta, run)
    stored, now = _tokenizers(meta, os.path.join(directory, str(step)), run)
    if not _same_tokenizer(stored, now):
      diff.append(f'tokenizer: {_tokenizer_name(stored)} in the checkpoint, '
                  f'{_tokenizer_name(now)} now')
    if diff:
      raise ValueError(f'{workdir} has checkpoints of another run (' + '; '.join(diff)
                       + '): use another --workdir, or delete its checkpoints/ to start over')
    path = os.path.join(workdir, 'metrics.jsonl')
    if os.path.exists(path):
      metrics_lib.read_records(path)  # a damaged line is named now, not after compiling
    return step
  if cfg.init_from:
    source, step = checkpoint.resolve(cfg.init_from)
    meta = checkpoint.read_meta(source, step)
    stored, now = _tokenizers(meta, cfg.init_from, run)
    if not _same_tokenizer(stored, now):  # same shapes, each embedding row another token's
      raise ValueError(f'init_from={cfg.init_from} was trained on the ids of tokenizer '
                       f'{_tokenizer_name(stored)}, this run uses {_tokenizer_name(now)} '
                       f'(data.tokenizer={cfg.data.tokenizer!r}): set --config.data.tokenizer '
                       'to the checkpoint\'s tokenizer')
    diff = checkpoint.differences(
        {k: v for k, v in meta['arrays'].items() if not checkpoint.is_optimizer(k)},
        checkpoint.describe(checkpoint.flatten(run.model.params)))
    if diff:
      raise ValueError(f'init_from={cfg.init_from}: {len(diff)} parameter(s) differ from '
                       'the model: ' + '; '.join(diff[:20]))
  return None


def _tokenizers(meta: dict, path: str, run: Run) -> tuple[dict | None, dict | None]:
  """(the checkpoint's tokenizer, this run's) as loop.tokenizer_identity gives them (None:
  unknown, nothing to compare).

  Checkpoints from before the tokenizer was recorded: the tokenizer file beside them
  (hf-import) or their run's data.tokenizer (tokenizer.for_checkpoint), where it still
  exists; a byte-level run's, unless it trained on token files or synthetic tokens.
  """
  now = loop.tokenizer_identity(run.cfg.data.tokenizer, run.corpus.byte_level)
  if 'tokenizer' in meta:
    stored = meta['tokenizer']
  else:
    spec = tokenizer_lib.for_checkpoint(path)
    data_path = meta.get('config', {}).get('data', {}).get('path')
    try:
      stored = loop.tokenizer_identity(spec, data_path is not None and not (
          data_path == 'synthetic' or data_path.endswith(('.npy', '.bin'))))
    except ValueError:  # its tokenizer file is gone: nothing to compare with
      stored = None
  return stored, now


def _same_tokenizer(a: dict | None, b: dict | None) -> bool:
  """By content: a tokenizer file renamed or moved is the same tokenizer."""
  return a is None or b is None or a.get('sha256') == b.get('sha256')


def _tokenizer_name(identity: dict) -> str:
  if 'sha256' not in identity:
    return "'' (byte-level)"
  return f'{identity["name"]} (sha256 {identity["sha256"][:12]})'


def _data_differences(meta: dict, run: Run) -> list[str]:
  """What defines the training batches, where checkpoint ``meta``'s differs from this run's.

  Two kinds of data (a text file's windows, a prepared corpus's documents) are
  identified by different keys: then the paths are named, as each run set them.
  """
  stored = meta.get('data', {}).get('stream')
  now = pipeline.identity(run.corpus, run.cfg.batch_size, run.cfg.seq_len)
  if stored is None:  # written before checkpoints recorded it
    return []
  # A key the checkpoint lacks was added after it was written: compared where recorded.
  diff = [f'data {k}: {stored[k]!r} in the checkpoint, {now[k]!r} now'
          for k in sorted(stored) if k in now and stored[k] != now[k]]
  missing = sorted(set(stored) - set(now))  # another kind of data: name it as set
  before = meta.get('config', {}).get('data', {}).get('path')
  if missing and before is not None:
    diff.insert(0, f'data.path: {before!r} in the checkpoint, {run.cfg.data.path!r} now')
  elif missing:
    diff += [f'data {k}: {stored[k]!r} in the checkpoint, absent now' for k in missing]
  return diff


def _check_workdir(workdir: str | None) -> None:
  scheme, sep, rest = (workdir or '').partition('://')
  if sep:
    bucket = rest.split('/')[0] or 'BUCKET'
    raise ValueError(f'--workdir {workdir}: {scheme}:// paths are not supported yet; mount '
                     f'the bucket (gcsfuse {bucket} /mnt/{bucket}) and pass the local path '
                     f'(--workdir /mnt/{rest})')
  if not workdir:
    return
  validation.check_workdir(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f'--workdir {workdir} exists and is not a directory')
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):  # checked before JAX starts, not when it is created
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f'--workdir {workdir}: {existing} is not a directory this user can '
                     'write to')


def start_workdir(run: Run, writer_enabled: bool) -> None:
  """Creates the workdir. An earlier run's outputs there are replaced later, once this
  run has compiled and its first steps passed (loop.begin_outputs)."""
  if writer_enabled:
    os.makedirs(run.workdir, exist_ok=True)


def lock_workdir(workdir: str):
  """Takes ``workdir`` for this run; raises ConfigError naming the process that has it.

  Process 0 holds an flock on ``WORKDIR/ringtrain.lock`` (recording its pid and
  host) until release_workdir(). The kernel drops the lock of a process that
  ends however it ends (kill -9 included), so a dead run's lock is taken over.
  Every process learns the outcome: a refused multi-process run exits 2 in all.
  Returns the open lock file on process 0, else None.
  """
  lock, holder = _take_lock(workdir) if jax.process_index() == 0 else (None, {})
  pid = holder.get('pid', 0)
  if jax.process_count() > 1:
    pid = int(multihost_utils.broadcast_one_to_all(np.int32(pid)))
  if pid:
    who = (f'pid {pid}' + (f' on {holder["host"]}' if holder.get('host') else '')
           if pid > 0 else 'a process that is starting')
    raise ConfigError(f'{workdir} is in use by another run ({who}): wait for it to end or '
                      'stop it, or use another --workdir')
  return lock


def _take_lock(workdir: str):
  """(the locked file, {}), or (None, the holder's record) when another process has it."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.abspath(os.path.join(workdir, LOCK_FILE))
  while True:
    f = open(path, 'a+', encoding='utf-8')  # pylint: disable=consider-using-with
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      holder = f.read()
      f.close()
      try:
        return None, json.loads(holder)
      except ValueError:  # locked a moment ago, the pid not yet written
        return None, {'pid': -1}
    except OSError as e:  # a filesystem without locks
      print(f'warning: cannot lock {path} ({e.strerror}): make sure no other run uses '
            f'{workdir}', file=sys.stderr)
      break
    try:
      if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
        break
    except FileNotFoundError:
      pass
    f.close()  # its holder removed the file between our open and flock: lock the new one
  f.seek(0)
  f.truncate()
  f.write(json.dumps({'pid': os.getpid(), 'host': socket.gethostname()}) + '\n')
  f.flush()
  return f, {}


def release_workdir(lock) -> None:
  """Removes the lock file, then drops the lock (in this order: see _take_lock)."""
  if lock is None:
    return
  try:
    os.remove(lock.name)
  except FileNotFoundError:
    pass
  lock.close()


def main(argv=None) -> int:
  args, overrides = parse_args(argv)
  # Orbax logs a failed save's traceback at ERROR, then raises it: the error line says it.
  logging.getLogger('absl').setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
  try:
    run = prepare(args, overrides)
    last = run.cfg.stop_after or run.cfg.steps
    if run.resume_step is not None and run.resume_step >= last:
      print(f'{run.workdir} is already at step {run.resume_step} (of {last}): nothing to do')
      return 0
    lock = lock_workdir(run.workdir)
  except ValueError as e:  # ConfigError, or a corrupt checkpoint (exit status 1)
    print(f'error: {e}', file=sys.stderr)
    return getattr(e, 'exit_status', 2)
  except KeyboardInterrupt:
    print('interrupted (SIGINT) before training started: nothing to save', file=sys.stderr)
    return 128 + signal.SIGINT
  try:
    return _train(run, args.verbose)
  finally:
    release_workdir(lock)


def _train(run: Run, verbose: bool = False) -> int:
  """Trains a prepared run in its locked workdir; returns the exit status."""
  try:
    # Again, now that no other run can write there: one may have, until the lock.
    run.resume_step = _validated(_check_checkpoints, run)
    start_workdir(run, writer_enabled=jax.process_index() == 0)
    loop.train(run)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except checkpoint.CheckpointError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  except loop.Stopped as e:
    print(f'{"error: " if e.exit_code == 3 else ""}{e}', file=sys.stderr)
    return e.exit_code
  except KeyboardInterrupt:  # before the loop handles SIGINT (compiling): nothing to save
    print('interrupted (SIGINT) before training started: nothing to save', file=sys.stderr)
    return 128 + signal.SIGINT
  except OSError as e:  # a full disk, an I/O error, permissions: the cause, in one line
    if verbose:
      traceback.print_exc()
    print(f'error: {checkpoint.os_cause(e)}'
          + ('' if verbose else ' (--verbose prints the traceback)'), file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  cli.run(main)
