r"""Trains a Transformer LM from a config file.

  python -m trainer.train --config configs/default.py [--workdir DIR] \
      [--config.a.b=value ...]

Outputs in the workdir (default ``runs/<config name>``): ``config.json`` (the
resolved config), ``metrics.jsonl`` (one JSON object per logged step and per
eval), TensorBoard event files in ``tb/`` and ``parallelism_report.json`` (what
the parallelism layer decided for every dense layer). Bad input exits with status 2
and a one-line message before anything is compiled or written; so does a workdir
another run is using (it holds ``ringtrain.lock`` there, see lock_workdir). A
corrupt checkpoint exits with status 1, naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import shutil
import socket
import sys
from typing import Any

import ml_collections

from trainer import config as config_lib
from trainer.config import ConfigError

LOCK_FILE = 'ringtrain.lock'  # in the workdir while a run uses it (lock_workdir)


@dataclasses.dataclass
class Run:
  """Everything validated before compilation starts."""
  cfg: ml_collections.ConfigDict
  workdir: str
  mesh: Any
  rules: Any
  model_cfg: Any
  corpus: Any
  abstract_params: Any = None     # shapes and dtypes of the model's parameters
  resume_step: int | None = None  # the newest checkpoint in the workdir, if any


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m trainer.train', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', required=True, help='config file, path.py[:arg]')
  parser.add_argument('--workdir', default=None, help='output directory')
  return parser.parse_known_args(argv)


def prepare(args, overrides) -> Run:
  """Loads and checks everything a run needs; raises ConfigError on bad input."""
  cfg = config_lib.load(args.config, overrides)
  return _validated(_prepare, cfg, args)


def prepare_loaded(cfg, workdir: str) -> Run:
  """prepare() for a config already loaded (trainer/evaluate.py)."""
  return _validated(_prepare, cfg, argparse.Namespace(config='', workdir=workdir))


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


def _prepare(cfg, args) -> Run:
  _check_workdir(args.workdir)
  _check_run_lengths(cfg)
  _check_seed(cfg.seed)
  profile = _start_jax(cfg)
  resolve_attention(cfg, profile.platform)
  from parallelism import mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top
  from trainer import data  # pylint: disable=g-import-not-at-top
  mesh = mesh_lib.make_mesh(cfg.mesh)
  rules = sharding.normalize_rules(cfg.mesh.logical_axis_rules)
  model_cfg, params = check_layout(cfg, mesh.shape)
  corpus = data.load(cfg.data, model_cfg.vocab_size, cfg.seed)
  data.check_lengths(corpus, cfg.seq_len, cfg.batch_size, cfg.eval_steps)
  workdir = args.workdir or os.path.join('runs', os.path.splitext(
      os.path.basename(args.config.partition(':')[0]))[0])
  run = Run(cfg, workdir, mesh, rules, model_cfg, corpus, params)
  run.resume_step = _check_checkpoints(run)
  return run


def _start_jax(cfg):
  """Starts JAX on this machine's platform with the chip's compiler flags.

  Sets ``hardware.name`` to the detected chip's profile ('auto'), or checks that
  the named one matches the devices; returns the profile. 'cpu' keeps to the
  CPU (simulated devices) whatever else the machine has.
  """
  # pylint: disable=g-import-not-at-top
  from launch import runtime
  from parallelism import hardware
  name = cfg.hardware.name
  if name != 'auto':
    hardware.get_profile(name)  # an unknown name: refused before JAX starts
  platform = 'cpu' if name == 'cpu' else runtime.probe_platform()
  runtime.configure_host(runtime.cpu_device_count(cfg.hardware.cpu_devices), platform=platform,
                         compiler_flags=hardware.startup_flags(name, platform,
                                                               cfg.hardware.xla_flags))
  runtime.start_distributed(runtime.distributed_settings(cfg.distributed),
                            cpu=platform == 'cpu')
  import jax
  try:
    devices = jax.devices()
  except RuntimeError as e:  # a visible TPU or GPU whose JAX plugin is missing or broken
    extra = {'tpu': 'tpu', 'gpu': 'cuda12'}.get(platform, platform)
    raise ValueError(f'JAX cannot open the {platform} ({str(e).splitlines()[0]}); install '
                     f"the {extra} extra (pip install -e '.[{extra}]'), or set "
                     'JAX_PLATFORMS=cpu to train on the CPU') from None
  profile = hardware.detect(name, [d.device_kind for d in devices])
  cfg.hardware.name = profile.name
  return profile


def resolve_attention(cfg, platform: str) -> None:
  """Sets ``model.attention`` to the implementation it names on ``platform``.

  'auto' becomes the one models/attention.py ``choose`` picks (recorded so in
  config.json and checkpoints); 'cudnn' where it cannot run raises ValueError.
  """
  from models import attention  # pylint: disable=g-import-not-at-top
  m = cfg.model
  m.attention = attention.choose(m.attention, platform, m.dtype, m.head_dim, cfg.seq_len,
                                 m.attention_block)


def check_layout(cfg, mesh_shape: dict):
  """Checks model, schedule, policy, lengths and divisibility for a mesh of ``mesh_shape`` sizes.

  Shapes only (no devices needed): the trainer and launch/aot.py (a TPU slice)
  both call it. Returns (TransformerConfig, abstract parameters).
  """
  # pylint: disable=g-import-not-at-top
  import types
  from flax import nnx
  from models.transformer import Transformer, TransformerConfig
  from parallelism import sharding
  from trainer import optim
  model_cfg = TransformerConfig.from_config(cfg.model, cfg.get('moe'))
  check_model(model_cfg)
  sharding.MatmulPolicy.from_config(cfg).validate()
  optim.validate(cfg.optimizer)
  if cfg.seq_len > model_cfg.max_seq_len:
    raise ValueError(f'seq_len={cfg.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}')
  block = min(model_cfg.attention_block, cfg.seq_len)
  if model_cfg.attention == 'blockwise' and cfg.seq_len % block:
    raise ValueError(f'seq_len={cfg.seq_len} is not a multiple of '
                     f'model.attention_block={model_cfg.attention_block}')
  mesh = types.SimpleNamespace(shape=dict(mesh_shape))
  rules = sharding.normalize_rules(cfg.mesh.logical_axis_rules)
  shards = sharding.mesh_axis_size(mesh, sharding.logical_to_spec(('batch',), rules)[0])
  accum = cfg.optimizer.grad_accum_steps
  if cfg.batch_size % (shards * accum):
    raise ValueError(f'batch_size={cfg.batch_size} is not divisible by data*fsdp={shards}'
                     f' x optimizer.grad_accum_steps={accum}')
  params = nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0))))
  sharding.check_divisible(params, sharding.state_specs(params, rules), mesh)
  return model_cfg, params


def check_model(model_cfg) -> None:
  """TransformerConfig.validate(), after the sizes it divides by: each at least 1."""
  for key in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
              'mlp_dim', 'max_seq_len'):
    if getattr(model_cfg, key) < 1:
      raise ValueError(f'model.{key}={getattr(model_cfg, key)} must be at least 1')
  model_cfg.validate()


def _check_checkpoints(run: Run) -> int | None:
  """Refuses, before compiling, a resume or an init_from that cannot work.

  Returns the step this run resumes from, if the workdir has checkpoints: the
  newest whose metadata reads (older ones only under checkpoint.on_corrupt=previous;
  the restore sets the others aside).
  """
  from trainer import checkpoint  # pylint: disable=g-import-not-at-top
  cfg, workdir = run.cfg, run.workdir
  policy = checkpoint.Policy.from_config(cfg.checkpoint)
  policy.validate()
  directory = checkpoint.directory_of(workdir)
  steps = checkpoint.complete_steps(directory)
  if steps:  # this run resumes: it must be the same model and data order
    meta, step = checkpoint.newest_good(steps, policy.on_corrupt,
                                        lambda s: checkpoint.read_meta(directory, s))
    diff = [f'model.{k}: {meta["model"].get(k)!r} in the checkpoint, {v!r} now'
            for k, v in dataclasses.asdict(run.model_cfg).items()
            if meta['model'].get(k) != v]
    if meta.get('seed') != cfg.seed:
      diff.append(f'seed: {meta.get("seed")} in the checkpoint, {cfg.seed} now')
    diff += _data_differences(meta.get('data', {}).get('stream'), run)
    if diff:
      raise ValueError(f'{workdir} has checkpoints of another run (' + '; '.join(diff)
                       + '): use another --workdir, or delete its checkpoints/ to start over')
    return step
  if cfg.init_from:
    source, step = checkpoint.resolve(cfg.init_from)
    meta = checkpoint.read_meta(source, step)
    diff = checkpoint.differences(
        {k: v for k, v in meta['arrays'].items() if not checkpoint.is_optimizer(k)},
        checkpoint.describe(checkpoint.flatten(run.abstract_params)))
    if diff:
      raise ValueError(f'init_from={cfg.init_from}: {len(diff)} parameter(s) differ from '
                       'the model: ' + '; '.join(diff[:20]))
  return None


def _data_differences(stored: dict | None, run: Run) -> list[str]:
  """What defines the training batches, where a checkpoint's differs from this run's."""
  from trainer import pipeline  # pylint: disable=g-import-not-at-top
  now = pipeline.identity(run.corpus, run.cfg.batch_size, run.cfg.seq_len)
  if stored is None:  # written before checkpoints recorded it
    return []
  return [f'data {k}: {stored.get(k)!r} in the checkpoint, {now.get(k)!r} now'
          for k in sorted(set(stored) | set(now)) if stored.get(k) != now.get(k)]


def _check_run_lengths(cfg) -> None:
  positive = ('steps', 'batch_size', 'seq_len', 'log_every', 'eval_steps')
  for key in positive:
    if cfg[key] < 1:
      raise ValueError(f'{key}={cfg[key]} must be at least 1')
  if cfg.eval_every < 0:
    raise ValueError(f'eval_every={cfg.eval_every} must be >= 0 (0: only at the end)')
  if cfg.optimizer.grad_accum_steps < 1:
    raise ValueError(f'optimizer.grad_accum_steps={cfg.optimizer.grad_accum_steps} must be >= 1')
  if cfg.stop_after is not None and not 0 < cfg.stop_after <= cfg.steps:
    raise ValueError(f'stop_after={cfg.stop_after} is not in [1, steps={cfg.steps}]')
  if cfg.on_nonfinite not in ('stop', 'skip'):
    raise ValueError(f'on_nonfinite={cfg.on_nonfinite!r} is not one of stop, skip')


def _check_seed(seed: int) -> None:
  if not 0 <= seed < 2**32:  # numpy's and JAX's seeds; a bad one failed after writing
    raise ValueError(f'seed={seed} is not in [0, 2**32)')


def _check_workdir(workdir: str | None) -> None:
  scheme, sep, rest = (workdir or '').partition('://')
  if sep:
    bucket = rest.split('/')[0] or 'BUCKET'
    raise ValueError(f'--workdir {workdir}: {scheme}:// paths are not supported yet; mount '
                     f'the bucket (gcsfuse {bucket} /mnt/{bucket}) and pass the local path '
                     f'(--workdir /mnt/{rest})')


def start_workdir(run: Run, writer_enabled: bool) -> None:
  """Creates the workdir; replaces an earlier run's outputs unless this run resumes it."""
  if not writer_enabled:
    return
  os.makedirs(run.workdir, exist_ok=True)
  old = [p for p in ('metrics.jsonl', 'tb') if os.path.exists(os.path.join(run.workdir, p))
         and run.resume_step is None]
  if old:
    print(f'{run.workdir}: replacing the outputs of an earlier run ({", ".join(old)})')
    for p in old:
      path = os.path.join(run.workdir, p)
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  with open(os.path.join(run.workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(run.cfg.to_json(indent=2) + '\n')


def lock_workdir(workdir: str):
  """Takes ``workdir`` for this run; raises ConfigError naming the process that has it.

  Process 0 holds an flock on ``WORKDIR/ringtrain.lock`` (recording its pid and
  host) until release_workdir(). The kernel drops the lock of a process that
  ends however it ends (kill -9 included), so a dead run's lock is taken over.
  Every process learns the outcome: a refused multi-process run exits 2 in all.
  Returns the open lock file on process 0, else None.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
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
  try:
    return _train(run)
  finally:
    release_workdir(lock)


def _train(run: Run) -> int:
  """Trains a prepared run in its locked workdir; returns the exit status."""
  from trainer import loop  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from trainer.checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
  try:
    # Again, now that no other run can write there: one may have, until the lock.
    run.resume_step = _validated(_check_checkpoints, run)
    start_workdir(run, writer_enabled=jax.process_index() == 0)
    loop.train(run)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except CheckpointError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  except loop.Stopped as e:
    print(f'{"error: " if e.exit_code == 3 else ""}{e}', file=sys.stderr)
    return e.exit_code
  return 0


if __name__ == '__main__':
  sys.exit(main())
