"""Checkpoints, on Orbax: the only module of ours that imports it.

A run keeps its checkpoints in ``WORKDIR/checkpoints/<step>/``, each with the
items ``params`` and ``opt_state`` (sharded arrays; every process writes its
own shards) and ``meta`` (JSON: the step, the model config, the layer layout,
every array's shape, dtype and checksum, and the run config). Orbax writes a
checkpoint into a temporary directory and renames it when it is complete, so a
process killed in the middle of a save leaves nothing that looks like a
checkpoint; such leftovers are ignored.

Every array is stored under a flat dotted name (``blocks.0.attn.q_dnh``,
``opt.0.mu.blocks.0.attn.q_dnh``), so restores can say which names differ, and
restoring onto another mesh or device count is a matter of the target
shardings. Restores verify each array against its checksum (a position-weighted
wraparound sum of its bits, the same however the array is sharded), so files
that were truncated or altered are caught even when the storage layer reads
them without complaint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

FORMAT = 'ringtrain-checkpoint-1'
SUBDIR = 'checkpoints'


class CheckpointError(ValueError):
  """A checkpoint that is missing, unreadable, corrupted or incompatible."""


# ------------------------------------------------------------ flat names

def flatten(tree) -> dict[str, Any]:
  """``{dotted name: leaf}`` of a pytree (nnx.State, optax state, dicts)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out[jax.tree_util.keystr(path, simple=True, separator='.').removesuffix('.value')] = leaf
  return out


def unflatten(like, flat: dict[str, Any]):
  """Puts ``flat``'s arrays into the structure of ``like`` (same names)."""
  names = list(flatten(like))
  return jax.tree.unflatten(jax.tree.structure(like), [flat[n] for n in names])


def describe(flat: dict[str, Any]) -> dict[str, list]:
  """``{name: [shape, dtype]}``, as stored in the metadata."""
  return {k: [list(v.shape), str(np.dtype(v.dtype))] for k, v in flat.items()}


def differences(stored: dict[str, list], wanted: dict[str, list]) -> list[str]:
  """Names missing, unexpected, or of another shape, one line each."""
  out = [f'{k}: in the checkpoint, not in the model' for k in stored if k not in wanted]
  out += [f'{k}: in the model, not in the checkpoint' for k in wanted if k not in stored]
  out += [f'{k}: shape {tuple(stored[k][0])} in the checkpoint, {tuple(wanted[k][0])} in '
          'the model' for k in wanted if k in stored and stored[k][0] != wanted[k][0]]
  return out


# -------------------------------------------------------------- checksums

@jax.jit
def _checksums(flat: dict[str, jax.Array]) -> dict[str, jax.Array]:
  def one(x):
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    u = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    for axis in range(x.ndim):  # row-major position, wrapping at 2**32
      index = index * jnp.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(
          jnp.uint32, x.shape, axis)
    return jnp.sum(u * (index * jnp.uint32(2654435761) + 1), dtype=jnp.uint32)
  return {k: one(v) for k, v in flat.items()}


def checksums(flat: dict[str, jax.Array]) -> dict[str, int]:
  """One 32-bit checksum per array, independent of how it is sharded."""
  return {k: int(v) for k, v in jax.device_get(_checksums(flat)).items()}


def _verify(flat: dict[str, jax.Array], meta: dict, where: str) -> None:
  stored = meta['checksums']
  comparable = {k: v for k, v in flat.items()
                if str(np.dtype(v.dtype)) == meta['arrays'][k][1]}
  bad = sorted(k for k, v in checksums(comparable).items() if v != stored[k])
  if bad:
    raise CheckpointError(f'{where} is corrupted: {len(bad)} array(s) fail their checksum '
                          f'({", ".join(bad[:3])}{", ..." if len(bad) > 3 else ""})')


# ------------------------------------------------------------- locations

def directory_of(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), SUBDIR)


def resolve(path: str) -> tuple[str, int]:
  """(checkpoints directory, step) for a workdir, its checkpoints/ or a step directory.

  A workdir or checkpoints directory means its latest complete checkpoint.
  """
  path = os.path.abspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f'no such checkpoint path: {path}')
  base = os.path.basename(path)
  if base.isdigit() and _is_complete(path):
    return os.path.dirname(path), int(base)
  directory = path if base == SUBDIR else os.path.join(path, SUBDIR)
  steps = complete_steps(directory)
  if not steps:
    raise CheckpointError(f'{path} is not a checkpoint: expected a workdir with '
                          f'{SUBDIR}/<step>/, its {SUBDIR}/ directory or a step directory')
  return directory, steps[-1]


def _is_complete(step_dir: str) -> bool:
  return os.path.isdir(os.path.join(step_dir, 'meta'))


def complete_steps(directory: str) -> list[int]:
  """Steps of complete checkpoints (Orbax renames a step directory into place last)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and _is_complete(os.path.join(directory, d)))


def read_meta(directory: str, step: int) -> dict:
  """The JSON metadata of one checkpoint."""
  where = os.path.join(directory, str(step))
  try:
    with ocp.CheckpointManager(directory, item_names=('meta',),
                               options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
      meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'checkpoint {where}: cannot read its metadata '
                          f'({type(e).__name__}: {str(e).splitlines()[0][:200]})') from None
  if not isinstance(meta, dict) or meta.get('format') != FORMAT:
    raise CheckpointError(f'{where} is not a ringtrain checkpoint (format '
                          f'{meta.get("format") if isinstance(meta, dict) else None!r})')
  return meta


def peek_model_config(path: str) -> dict:
  """The model config stored with the checkpoint at ``path``, read without starting JAX.

  For config files (``configs/finetune.py``), which run before the devices are
  set up.
  """
  try:
    return peek_meta(path)['model']
  except (KeyError, TypeError) as e:
    raise CheckpointError(f'{path}: no model config in the checkpoint metadata '
                          f'({type(e).__name__})') from None


def peek_meta(path: str) -> dict:
  """The metadata of the checkpoint at ``path``, read without starting JAX.

  Reads the JSON file that ``ocp.args.JsonSave`` writes for ``meta``.
  """
  directory, step = resolve(path)
  meta_file = os.path.join(directory, str(step), 'meta', 'metadata')
  try:
    with open(meta_file, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f'{meta_file}: cannot read the checkpoint metadata '
                          f'({type(e).__name__})') from None


# --------------------------------------------------------------- a run's

@dataclasses.dataclass
class Policy:
  """When to save and what to keep (the ``checkpoint.*`` config group)."""
  every: int = 0             # steps between saves; 0 disables checkpointing
  keep: int = 3              # most recent checkpoints kept
  keep_period: int = 0       # also keep every step divisible by this (0: none)
  async_save: bool = True    # write in the background while training goes on
  on_corrupt: str = 'error'  # error | previous: set bad ones aside, resume from an older one

  @classmethod
  def from_config(cls, cfg) -> 'Policy':
    return cls(**{f.name: cfg[f.name] for f in dataclasses.fields(cls)})

  def validate(self) -> None:
    for key, low in (('every', 0), ('keep', 1), ('keep_period', 0)):
      if getattr(self, key) < low:
        raise ValueError(f'checkpoint.{key}={getattr(self, key)} must be >= {low}')
    if self.on_corrupt not in ('error', 'previous'):
      raise ValueError(f'checkpoint.on_corrupt={self.on_corrupt!r} is not one of error, '
                       'previous')


class Checkpointer:
  """Saves and restores one run's TrainState (see the module docstring)."""

  def __init__(self, workdir: str, policy: Policy):
    self.directory, self.policy = directory_of(workdir), policy
    options = ocp.CheckpointManagerOptions(
        max_to_keep=policy.keep, keep_period=policy.keep_period or None,
        enable_async_checkpointing=policy.async_save, cleanup_tmp_directories=True)
    self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                       item_names=('params', 'opt_state', 'meta'))

  def steps(self) -> list[int]:
    return complete_steps(self.directory)

  def save(self, state, meta: dict) -> None:
    """Starts saving ``state``; returns once its arrays are copied off the devices."""
    step = int(state.step)
    params, opt = flatten(state.params), flatten({'step': state.step, 'opt': state.opt_state})
    meta = {**meta, 'format': FORMAT, 'step': step,
            'arrays': {**describe(params), **describe(opt)},
            'checksums': {**checksums(params), **checksums(opt)}}
    self._mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt),
        meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, abstract_state) -> tuple[Any, int]:
    """The newest good checkpoint as a state sharded like ``abstract_state``."""
    steps = self.steps()
    for i, step in enumerate(reversed(steps)):
      try:
        return self._restore(step, abstract_state), step
      except CheckpointError as e:
        if self.policy.on_corrupt != 'previous' or i == len(steps) - 1:
          hint = ('' if self.policy.on_corrupt == 'previous' else
                  '; --config.checkpoint.on_corrupt=previous resumes from the newest '
                  'readable earlier checkpoint')
          raise CheckpointError(f'{e}{hint}') from None
        self._set_aside(step, e)
    raise CheckpointError(f'no checkpoint in {self.directory}')

  def _set_aside(self, step: int, error: CheckpointError) -> None:
    """Renames a bad checkpoint out of the way (kept for inspection), so it is redone."""
    bad = os.path.join(self.directory, str(step))
    if jax.process_index() == 0:
      os.replace(bad, f'{bad}.corrupt')
      print(f'warning: {error}; moved it to {bad}.corrupt and trying the previous checkpoint')
    ocp.multihost.sync_global_processes(f'ringtrain_set_aside_{step}')
    self._mngr.reload()

  def _restore(self, step: int, abstract_state):
    where = os.path.join(self.directory, str(step))
    meta = read_meta(self.directory, step)
    target = flatten({'step': abstract_state.step, 'opt': abstract_state.opt_state})
    restored = _read_items(where, self._mngr, step, {
        'params': flatten(abstract_state.params), 'opt_state': target})
    _verify({**restored['params'], **restored['opt_state']}, meta, where)
    rest = unflatten({'step': abstract_state.step, 'opt': abstract_state.opt_state},
                     restored['opt_state'])
    return type(abstract_state)(rest['step'], unflatten(abstract_state.params,
                                                        restored['params']), rest['opt'])

  def wait(self) -> None:
    """Blocks until the last save is complete on disk."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()


def _read_items(where: str, mngr, step: int, targets: dict[str, dict]) -> dict:
  args = {name: ocp.args.StandardRestore(_as_restore_target(flat))
          for name, flat in targets.items()}
  try:
    return mngr.restore(step, args=ocp.args.Composite(**args))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'checkpoint {where} is unreadable ({type(e).__name__}: '
                          f'{str(e).splitlines()[0][:200]})') from None


def _as_restore_target(flat: dict) -> dict:
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
          for k, v in flat.items()}


# ---------------------------------------------------------- params only

def restore_params(path: str, abstract_params, model_meta: dict | None = None):
  """Parameters only from the checkpoint at ``path``, sharded like ``abstract_params``.

  Raises CheckpointError listing every parameter whose name or shape differs.
  """
  directory, step = resolve(path)
  meta = read_meta(directory, step)
  wanted = flatten(abstract_params)
  diff = differences({k: v for k, v in meta['arrays'].items() if not is_optimizer(k)},
                     describe(wanted))
  if diff:
    more = f'; and {len(diff) - 20} more' if len(diff) > 20 else ''
    raise CheckpointError(f'{os.path.join(directory, str(step))} does not fit the model '
                          f'({len(diff)} difference(s)): ' + '; '.join(diff[:20]) + more)
  where = os.path.join(directory, str(step))
  with ocp.CheckpointManager(directory, item_names=('params',),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    flat = _read_items(where, mngr, step, {'params': wanted})['params']
  _verify(flat, meta, where)
  return unflatten(abstract_params, flat)


def is_optimizer(name: str) -> bool:
  """Whether a stored name belongs to the optimizer item (step, optimizer state)."""
  return name == 'step' or name.startswith('opt.')


def write_params(directory: str, params, model_config: dict, *, source: str = '') -> str:
  """Writes parameters alone as a checkpoint (step 0) that ``init_from`` loads.

  ``params`` is a nested dict of arrays shaped like
  ``nnx.state(Transformer(...)).to_pure_dict()``; returns the step directory.
  """
  flat = {k: jnp.asarray(v) for k, v in flatten(params).items()}
  meta = {'format': FORMAT, 'step': 0, 'model': model_config, 'source': source,
          'arrays': describe(flat), 'checksums': checksums(flat)}
  with ocp.CheckpointManager(directory_of(directory), item_names=('params', 'meta'),
                             options=ocp.CheckpointManagerOptions(
                                 enable_async_checkpointing=False)) as mngr:
    mngr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(flat),
                                         meta=ocp.args.JsonSave(meta)), force=True)
  return os.path.join(directory_of(directory), '0')


def read_params(path: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(model config, nested dict of host arrays) of the checkpoint at ``path``."""
  directory, step = resolve(path)
  meta = read_meta(directory, step)
  where = os.path.join(directory, str(step))
  as_numpy = {k: ocp.RestoreArgs(restore_type=np.ndarray)
              for k in meta['arrays'] if not is_optimizer(k)}
  with ocp.CheckpointManager(directory, item_names=('params',),
                             options=ocp.CheckpointManagerOptions(read_only=True)) as mngr:
    try:
      flat = mngr.restore(step, args=ocp.args.Composite(
          params=ocp.args.PyTreeRestore(restore_args=as_numpy))).params
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'checkpoint {where} is unreadable ({type(e).__name__}: '
                            f'{str(e).splitlines()[0][:200]})') from None
  _verify({k: jnp.asarray(v) for k, v in flat.items()}, meta, where)
  nested: dict = {}
  for name, value in flat.items():
    node = nested
    *parents, leaf = name.split('.')
    for part in parents:
      node = node.setdefault(int(part) if part.isdigit() else part, {})
    node[int(leaf) if leaf.isdigit() else leaf] = np.asarray(value)
  return meta['model'], nested
