r"""Trains a Transformer LM from a config file.

  python -m trainer.train --config configs/default.py [--workdir DIR] \
      [--config.a.b=value ...]

Outputs in the workdir (default ``runs/<config name>``): ``config.json`` (the
resolved config), ``metrics.jsonl`` (one JSON object per logged step and per
eval), TensorBoard event files in ``tb/`` and ``parallelism_report.json`` (what
the parallelism layer decided for every dense layer). Bad input exits with status 2
and a one-line message before anything is compiled or written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from typing import Any

import ml_collections

from trainer import config as config_lib
from trainer.config import ConfigError


@dataclasses.dataclass
class Run:
  """Everything validated before compilation starts."""
  cfg: ml_collections.ConfigDict
  workdir: str
  mesh: Any
  rules: Any
  model_cfg: Any
  corpus: Any


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m trainer.train', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', required=True, help='config file, path.py[:arg]')
  parser.add_argument('--workdir', default=None, help='output directory')
  return parser.parse_known_args(argv)


def prepare(args, overrides) -> Run:
  """Loads and checks everything a run needs; raises ConfigError on bad input."""
  cfg = config_lib.load(args.config, overrides)
  try:
    return _prepare(cfg, args)
  except (KeyError, ValueError) as e:  # validators below raise ValueError
    raise ConfigError(str(e).strip('"')) from None


def _prepare(cfg, args) -> Run:
  from launch import runtime  # pylint: disable=g-import-not-at-top
  _check_run_lengths(cfg)
  runtime.configure_host(runtime.cpu_device_count(cfg.hardware.cpu_devices),
                         cpu_only=cfg.hardware.name == 'cpu')
  from models.transformer import TransformerConfig  # pylint: disable=g-import-not-at-top
  from parallelism import hardware, mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top
  from trainer import data  # pylint: disable=g-import-not-at-top
  model_cfg = TransformerConfig.from_config(cfg.model)
  model_cfg.validate()
  hardware.get_profile(cfg.hardware.name)
  sharding.MatmulPolicy.from_config(cfg).validate()
  if cfg.seq_len > model_cfg.max_seq_len:
    raise ValueError(f'seq_len={cfg.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}')
  corpus = data.load_corpus(cfg.data, model_cfg.vocab_size, cfg.seed)
  data.check_lengths(corpus, cfg.seq_len, cfg.batch_size, cfg.eval_steps)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  rules = sharding.normalize_rules(cfg.mesh.logical_axis_rules)
  shards = sharding.mesh_axis_size(mesh, sharding.logical_to_spec(('batch',), rules)[0])
  accum = cfg.optimizer.grad_accum_steps
  if cfg.batch_size % (shards * accum):
    raise ValueError(f'batch_size={cfg.batch_size} is not divisible by data*fsdp={shards}'
                     f' x optimizer.grad_accum_steps={accum}')
  workdir = args.workdir or os.path.join('runs', os.path.splitext(
      os.path.basename(args.config.partition(':')[0]))[0])
  return Run(cfg, workdir, mesh, rules, model_cfg, corpus)


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
  if cfg.checkpoint.every:
    raise ValueError(f'checkpoint.every={cfg.checkpoint.every}: checkpointing is not '
                     'available yet; leave it at 0')


def start_workdir(run: Run, writer_enabled: bool) -> None:
  """Creates the workdir, replacing outputs of an earlier run (no resume yet)."""
  if not writer_enabled:
    return
  os.makedirs(run.workdir, exist_ok=True)
  old = [p for p in ('metrics.jsonl', 'tb') if os.path.exists(os.path.join(run.workdir, p))]
  if old:
    print(f'{run.workdir}: replacing the outputs of an earlier run ({", ".join(old)})')
    for p in old:
      path = os.path.join(run.workdir, p)
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  with open(os.path.join(run.workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(run.cfg.to_json(indent=2) + '\n')


def main(argv=None) -> int:
  args, overrides = parse_args(argv)
  try:
    run = prepare(args, overrides)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  from trainer import loop  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  start_workdir(run, writer_enabled=jax.process_index() == 0)
  loop.train(run)
  return 0


if __name__ == '__main__':
  sys.exit(main())
