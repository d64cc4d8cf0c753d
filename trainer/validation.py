"""Every check of a run's config, in one place; bad input raises ValueError naming it.

``validate(cfg)`` (what ``Config.validate`` runs): each value on its own and
against the others, without devices, before JAX starts. ``resolve_attention``:
``model.attention`` on the platform the run found. ``check_layout``: the batch
and every parameter divide over a mesh of given sizes; shapes only, so
launch.aot checks a TPU slice on this CPU. The entry points turn the
ValueErrors into one line and exit status 2.
"""

from __future__ import annotations

import math
import types
from typing import Any

from models import attention
from models.transformer import SPLASH_KV, SPLASH_Q
from parallelism import hardware, sharding
from trainer import data, files, optim
from trainer.config import Config

# The longest path a run writes below its workdir, with room to spare: Orbax's temporary
# step directories (checkpoints/N.orbax-checkpoint-tmp-TIME/state/ocdbt.process_K/d/HASH)
# and TensorBoard's event files (tb/events.out.tfevents.TIME.HOST.PID.N, HOST up to 64).
WORKDIR_BELOW = 256

def validate(cfg: Config) -> None:
  """Raises ValueError for the first value a run cannot use."""
  _check_run(cfg)
  check_model(cfg.transformer())
  if cfg.hardware.name != 'auto':
    hardware.get_profile(cfg.hardware.name)  # an unknown name: refused before JAX starts
  hardware.check_flags(cfg.hardware.xla_flags)
  sharding.normalize_rules(cfg.mesh.logical_axis_rules)
  sharding.MatmulPolicy.from_config(cfg).validate()
  if cfg.hardware.peak_flops < 0:
    raise ValueError(f'hardware.peak_flops={cfg.hardware.peak_flops} must be >= 0 '
                     '(0: from the profile)')
  _check_optimizer(cfg.optimizer)
  _check_checkpoint(cfg.checkpoint)
  m = cfg.model
  if cfg.seq_len > m.max_seq_len:
    raise ValueError(f'seq_len={cfg.seq_len} exceeds model.max_seq_len={m.max_seq_len}')
  if m.attention == 'blockwise' and cfg.seq_len % min(m.attention_block, cfg.seq_len):
    raise ValueError(f'seq_len={cfg.seq_len} is not a multiple of '
                     f'model.attention_block={m.attention_block}')


def check_workdir(workdir: str) -> None:
  """The workdir and the files a run writes below it fit the file system's limits."""
  files.check_length(workdir, '--workdir ', below=WORKDIR_BELOW)


def check_model(model_cfg) -> None:
  """TransformerConfig.validate(), after the sizes it divides by: each at least 1.

  Also for models that come from elsewhere (trainer/convert.py, trainer/generate.py).
  """
  for key in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
              'mlp_dim', 'max_seq_len'):
    if getattr(model_cfg, key) < 1:
      raise ValueError(f'model.{key}={getattr(model_cfg, key)} must be at least 1')
  for key in ('rope_theta', 'norm_eps'):  # else the run compiles, then its loss is NaN
    if not (math.isfinite(getattr(model_cfg, key)) and getattr(model_cfg, key) > 0):
      raise ValueError(f'model.{key}={getattr(model_cfg, key)} must be finite and > 0')
  if model_cfg.head_dim % 2:  # rotary embeddings turn pairs of features
    raise ValueError(f'model.head_dim={model_cfg.head_dim} must be even (rotary embeddings)')
  model_cfg.validate()


def _check_run(cfg: Config) -> None:
  for key in ('steps', 'batch_size', 'seq_len', 'log_every', 'eval_steps'):
    if getattr(cfg, key) < 1:
      raise ValueError(f'{key}={getattr(cfg, key)} must be at least 1')
  if cfg.eval_every < 0:
    raise ValueError(f'eval_every={cfg.eval_every} must be >= 0 (0: only at the end)')
  if cfg.optimizer.grad_accum_steps < 1:
    raise ValueError(f'optimizer.grad_accum_steps={cfg.optimizer.grad_accum_steps} must be >= 1')
  if cfg.stop_after is not None and not 0 < cfg.stop_after <= cfg.steps:
    raise ValueError(f'stop_after={cfg.stop_after} is not in [1, steps={cfg.steps}]')
  if cfg.aot.measured_attention not in ('causal', 'full', 'none'):
    raise ValueError(f'aot.measured_attention={cfg.aot.measured_attention!r} is not one of '
                     'causal, full, none')
  if cfg.on_nonfinite not in ('stop', 'skip'):
    raise ValueError(f'on_nonfinite={cfg.on_nonfinite!r} is not one of stop, skip')
  if not 0 <= cfg.seed < 2**32:  # numpy's and JAX's seeds; a bad one failed after writing
    raise ValueError(f'seed={cfg.seed} is not in [0, 2**32)')
  if cfg.data.prefetch < 0:  # a queue of negative size has no bound
    raise ValueError(f'data.prefetch={cfg.data.prefetch} must be >= 0 (0: no background thread)')
  paths = cfg.data.path.split(',')
  if len(paths) > 1 and not all(p.strip() for p in paths):
    raise ValueError(f'data.path={cfg.data.path!r} has an empty entry (a mixture names its '
                     'corpora separated by single commas)')
  data.parse_weights(cfg.data.weights, len(paths))
  if cfg.hardware.cpu_devices < 1:  # JAX would start with no CPU device
    raise ValueError(f'hardware.cpu_devices={cfg.hardware.cpu_devices} must be at least 1')
  prof = cfg.profile
  if prof.start_step < 0 or prof.num_steps < 0:
    raise ValueError(f'profile.start_step={prof.start_step} and profile.num_steps='
                     f'{prof.num_steps} must be >= 0')
  if prof.num_steps and prof.start_step >= cfg.steps:
    raise ValueError(f'profile.start_step={prof.start_step} traces nothing: the run has '
                     f'updates 0 to {cfg.steps - 1} (steps={cfg.steps})')


def _check_optimizer(opt) -> None:
  """A schedule that optim.learning_rate_schedule can build."""
  if opt.schedule not in optim.SCHEDULES:
    raise ValueError(f'optimizer.schedule={opt.schedule!r} is not one of '
                     f'{", ".join(optim.SCHEDULES)}')
  if not (math.isfinite(opt.learning_rate) and opt.learning_rate > 0):
    raise ValueError(f'optimizer.learning_rate={opt.learning_rate} must be finite and > 0')
  if opt.warmup_steps < 0:
    raise ValueError(f'optimizer.warmup_steps={opt.warmup_steps} must be >= 0')
  for key in ('end_lr_fraction', 'decay_fraction'):
    if not 0 <= getattr(opt, key) <= 1:
      raise ValueError(f'optimizer.{key}={getattr(opt, key)} is not in [0, 1]')
  for key in ('b1', 'b2'):
    if not 0 <= getattr(opt, key) < 1:
      raise ValueError(f'optimizer.{key}={getattr(opt, key)} is not in [0, 1)')
  if not (math.isfinite(opt.eps) and opt.eps > 0):
    raise ValueError(f'optimizer.eps={opt.eps} must be finite and > 0')
  for key in ('weight_decay', 'grad_clip', 'z_loss'):
    if not (math.isfinite(getattr(opt, key)) and getattr(opt, key) >= 0):
      raise ValueError(f'optimizer.{key}={getattr(opt, key)} must be finite and >= 0 '
                       f'{"(0: off)" if key != "weight_decay" else ""}'.rstrip())
  for key in ('mu_dtype', 'nu_dtype'):
    if getattr(opt, key) not in optim.MOMENT_DTYPES:
      raise ValueError(f'optimizer.{key}={getattr(opt, key)!r} is not one of '
                       f'{", ".join(optim.MOMENT_DTYPES)}')


def _check_checkpoint(ckpt) -> None:
  for key, low in (('every', 0), ('keep', 1), ('keep_period', 0)):
    if getattr(ckpt, key) < low:
      raise ValueError(f'checkpoint.{key}={getattr(ckpt, key)} must be >= {low}')
  if ckpt.on_corrupt not in ('error', 'previous'):
    raise ValueError(f'checkpoint.on_corrupt={ckpt.on_corrupt!r} is not one of error, previous')


def resolve_attention(cfg: Config, platform: str) -> Config:
  """``cfg`` with ``model.attention`` the implementation it names on ``platform``.

  'auto' becomes the one models/attention.py ``choose`` picks (recorded so in
  config.json and checkpoints); 'cudnn' where it cannot run raises ValueError.
  """
  m = cfg.model
  return cfg.replace({'model.attention': attention.choose(
      m.attention, platform, m.dtype, m.head_dim, cfg.seq_len, m.attention_block)})


def check_layout(cfg: Config, mesh_shape: dict, params: Any) -> None:
  """Checks that the batch, MoE capacity and abstract ``params`` divide over a mesh of
  ``mesh_shape``."""
  mesh = types.SimpleNamespace(shape=dict(mesh_shape))
  rules = sharding.normalize_rules(cfg.mesh.logical_axis_rules)
  batch = sharding.logical_to_spec(('batch',), rules)[0]
  shards = sharding.mesh_axis_size(mesh, batch)
  accum = cfg.optimizer.grad_accum_steps
  if cfg.batch_size % (shards * accum):
    named = '*'.join(sharding.axes_of(batch)) or 'its devices'
    raise ValueError(f'batch_size={cfg.batch_size} is not divisible by {named}={shards}'
                     f' x optimizer.grad_accum_steps={accum}')
  moe = cfg.transformer().moe
  experts = [a for a in sharding.axes_of(sharding.logical_to_spec(('exp',), rules)[0])
             if mesh.shape[a] > 1]
  if moe.enabled and len(experts) > 1:  # parallelism/moe.py exchanges over one axis
    raise ValueError(f"the rules split 'exp' over {'*'.join(experts)}; expert parallelism "
                     'exchanges tokens over one mesh axis: map exp to one (e.g. expert)')
  if moe.enabled:  # each expert's slots, where the rules split them
    axes = sharding.logical_to_spec(('capacity',), rules)[0]
    slots, split = moe.capacity(cfg.seq_len), sharding.mesh_axis_size(mesh, axes)
    if slots % split:
      raise ValueError(f'moe capacity {slots} slots (seq_len={cfg.seq_len}, moe.capacity_factor='
                       f'{moe.capacity_factor}) is not divisible by {axes}={split}')
  if cfg.model.attention == 'splash':
    q, kv = (sharding.logical_to_spec(a, rules)[2] for a in (SPLASH_Q, SPLASH_KV))
    split = lambda e: tuple(a for a in sharding.axes_of(e) if mesh.shape[a] > 1)
    if split(q) != split(kv):
      raise ValueError(f"model.attention='splash' pairs each device's query heads with its "
                       f"own key/value heads: the rules split 'heads' over {split(q) or 'none'}"
                       f" and 'kv_heads' over {split(kv) or 'none'}; split both alike in "
                       "mesh.logical_axis_rules, or use model.attention='xla' or 'blockwise'")
  sharding.check_divisible(params, sharding.state_specs(params, rules), mesh)
