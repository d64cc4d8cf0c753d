"""Checkpoints, on Orbax: the only module of ours that imports it.

A run keeps its checkpoints in ``WORKDIR/checkpoints/<step>/``, each with the
items ``params`` and ``opt_state`` (sharded arrays; every process writes its
own shards) and ``meta`` (JSON: the step, the model config, the layer layout,
every array's shape, dtype and checksum, the run config, and under ``data``
what defines the training batches and the input pipeline's position). A checkpoint is
complete only once Orbax has written its commit marker (``commit_success.txt``,
the last file of a save; Orbax's commit-file mode, which writes in place and
renames nothing), so what a process killed in the middle of a save leaves is
never taken for a checkpoint, on any filesystem; the next start removes it.

Only what ringtrain wrote is ever removed: a save makes its step directory with
``ringtrain_save.txt`` in it before anything else (:class:`StepPath`), and only a
step directory holding that marker (or nothing at all) and no commit marker is
taken for an unfinished save of ours. Anything else under ``checkpoints/`` (a
backup, notes, ``-5/``, ``25.tmp/``, a file) is left as it is, named in one
warning line at the start; a save whose step directory exists and is not ours
stops the run instead of overwriting it.

A save that fails, in the foreground or in the background (permissions, a full
disk, an I/O error), is :class:`SaveFailed`: the loop learns of it at the next
step boundary (:meth:`Checkpointer.check`) and stops, naming the path and the
OS error; the last complete checkpoint is left as it was.

Every array is stored under a flat dotted name (``blocks.0.attn.q_dnh``,
``opt.0.mu.blocks.0.attn.q_dnh``), so restores can say which names differ, and
restoring onto another mesh or device count is a matter of the target
shardings. Restores verify each array against its checksum (a wraparound sum
over its elements of their bits mixed with their position, the same however
the array is sharded), so files that were truncated or altered are caught even
when the storage layer reads them without complaint. A checkpoint whose files
are damaged or missing, whose metadata is not what a save writes, or whose
arrays disagree with it is corrupt (:class:`CorruptCheckpoint`): the run stops
naming it, or with ``on_corrupt=previous`` sets it aside and uses the newest
good one. A restore failing otherwise (out of memory, an I/O error) is no
evidence of damage (:class:`UnreadableCheckpoint`): the run stops, moving nothing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from etils import epath
from orbax.checkpoint.path import atomicity

from trainer.config import Checkpoint

FORMAT = 'ringtrain-checkpoint-2'
# Formats restores read; they differ in the checksum (see _checksums).
FORMATS = ('ringtrain-checkpoint-1', FORMAT)
SUBDIR = 'checkpoints'
COMMIT_MARKER = 'commit_success.txt'  # orbax's atomicity_types.COMMIT_SUCCESS_FILE
OWN_MARKER = 'ringtrain_save.txt'  # the first file of a save: the step directory is ours
# In place, committed by COMMIT_MARKER: completeness does not rest on atomic renames
# (which GCS FUSE, for one, does not have).
ATOMICITY = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
RESUME_HINT = ('; --config.checkpoint.on_corrupt=previous resumes from the newest readable '
               'earlier checkpoint')


class CheckpointError(ValueError):
  """A checkpoint that is missing, unreadable, corrupted or incompatible."""


class CorruptCheckpoint(CheckpointError):
  """A complete checkpoint that cannot be read or disagrees with itself (exit status 1)."""
  exit_status = 1


class SaveFailed(CheckpointError):
  """A save that could not be written (permissions, a full disk, I/O); exit status 1."""
  exit_status = 1


class UnreadableCheckpoint(CheckpointError):
  """A restore that failed without evidence of damage (out of memory, I/O, permissions).

  Not corrupt: the checkpoint is left where it is and the run stops (exit status 1).
  """
  exit_status = 1


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

def _mix(h):
  """MurmurHash3's 32-bit finalizer: a bijection, every output bit depending on every input."""
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


@functools.partial(jax.jit, static_argnames='form')
def _checksums(flat: dict[str, jax.Array], form: str) -> dict[str, jax.Array]:
  def one(x):
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    u = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    for axis in range(x.ndim):  # row-major position, wrapping at 2**32
      index = index * jnp.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(
          jnp.uint32, x.shape, axis)
    if form == 'ringtrain-checkpoint-1':  # the multiplier is even at odd positions: their
      # top bit (a float32's sign) drops out mod 2**32; kept to verify what it wrote
      return jnp.sum(u * (index * jnp.uint32(2654435761) + 1), dtype=jnp.uint32)
    # An odd multiplier at every position (a bijection of each element's bits), then
    # mixed, so that every bit counts and changes do not cancel linearly; still a sum.
    return jnp.sum(_mix(u * ((index * 2 + 1) * jnp.uint32(2654435761))), dtype=jnp.uint32)
  return {k: one(v) for k, v in flat.items()}


def checksums(flat: dict[str, jax.Array], form: str = FORMAT) -> dict[str, int]:
  """One 32-bit checksum per array, independent of how it is sharded.

  ``form``: the checkpoint format whose checksum to compute (one of FORMATS).
  """
  return {k: int(v) for k, v in jax.device_get(_checksums(flat, form=form)).items()}


def _verify(flat: dict[str, jax.Array], meta: dict, where: str) -> None:
  """Every array as read must have the dtype and checksum its metadata records."""
  recorded = meta['arrays']
  retyped = sorted(k for k, v in flat.items() if str(np.dtype(v.dtype)) != recorded[k][1])
  if retyped:
    k = retyped[0]
    raise CorruptCheckpoint(f'{where} is corrupted: {len(retyped)} array(s) read with another '
                            f'dtype than recorded ({k}: {np.dtype(flat[k].dtype)}, recorded '
                            f'{recorded[k][1]})')
  bad = sorted(k for k, v in checksums(flat, meta['format']).items()
               if v != meta['checksums'][k])
  if bad:
    raise CorruptCheckpoint(f'{where} is corrupted: {len(bad)} array(s) fail their checksum '
                            f'({_some(bad)})')


def _some(names: list[str]) -> str:
  return ', '.join(names[:3]) + (', ...' if len(names) > 3 else '')


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
  directory = os.path.join(path, SUBDIR)
  if base == SUBDIR and (complete_steps(path) or not complete_steps(directory)):
    directory = path  # its checkpoints/ directory, not a workdir itself named so
  steps = complete_steps(directory)
  if not steps:
    raise CheckpointError(f'{path} is not a checkpoint: expected a workdir with '
                          f'{SUBDIR}/<step>/, its {SUBDIR}/ directory or a step directory')
  return directory, steps[-1]


def _is_complete(step_dir: str) -> bool:
  return os.path.isfile(os.path.join(step_dir, COMMIT_MARKER))


def complete_steps(directory: str) -> list[int]:
  """Steps of complete checkpoints: those with Orbax's commit marker (written last)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory)
                if d.isdigit() and _is_complete(os.path.join(directory, d)))


def is_unfinished_save(step_dir: str) -> bool:
  """Whether ``step_dir`` is a save of ours that never committed (safe to remove).

  A step directory (digits, a real directory) without the commit marker that
  holds OWN_MARKER, or nothing at all (a save killed between making its
  directory and marking it).
  """
  name = os.path.basename(step_dir)
  if not (name.isdigit() and os.path.isdir(step_dir)) or os.path.islink(step_dir):
    return False
  if _is_complete(step_dir):
    return False
  return os.path.isfile(os.path.join(step_dir, OWN_MARKER)) or not os.listdir(step_dir)


_SET_ASIDE = re.compile(r'\d+\.corrupt(\.\d+)?')  # Checkpointer._set_aside's names


def foreign_entries(directory: str) -> list[str]:
  """Names in a checkpoints directory that ringtrain did not write (left alone)."""
  if not os.path.isdir(directory):
    return []
  return sorted(n for n in os.listdir(directory) if not (
      n.isdigit() and (_is_complete(os.path.join(directory, n))
                       or is_unfinished_save(os.path.join(directory, n)))
      or _SET_ASIDE.fullmatch(n) and os.path.isdir(os.path.join(directory, n))))


class StepPath(atomicity.CommitFileTemporaryPath):
  """Orbax's in-place step directory (commit-file mode), which Orbax removes only if ours.

  Orbax takes any directory without a commit marker for an unfinished save and
  removes it: at start (``cleanup_tmp_directories``) and when a save of that step
  begins. Here a save marks its directory first (OWN_MARKER), only marked (or
  empty) directories count as unfinished saves, and a save refuses to replace a
  directory that is not ours.
  """

  @classmethod
  async def validate(cls, temporary_path: epath.Path):
    await super().validate(temporary_path)
    if not is_unfinished_save(os.fspath(temporary_path)):
      raise atomicity.ValidationError(f'{temporary_path} is not a save of ringtrain')

  async def create(self) -> epath.Path:
    path = os.fspath(self._tmp_path)
    if os.path.lexists(path) and not is_unfinished_save(path):
      raise FileExistsError(f'{path} exists and is not a checkpoint ringtrain started (no '
                            f'{OWN_MARKER}): move it away')
    mode = self._path_permission_mode

    async def mkdir_marked(tmp_dir, parents, exist_ok, mode=mode):
      def make():
        tmp_dir.mkdir(parents=parents, exist_ok=exist_ok,
                      **({'mode': mode} if mode is not None else {}))
        (tmp_dir / OWN_MARKER).write_text('a checkpoint being written by ringtrain; '
                                          f'complete once {COMMIT_MARKER} is here\n')
      await asyncio.to_thread(make)

    # pylint: disable-next=protected-access  # Orbax's own creation, with our mkdir
    return await atomicity._create_tmp_directory(
        mkdir_marked, self._tmp_path, path_permission_mode=mode,
        checkpoint_metadata_store=self._checkpoint_metadata_store)


def read_meta(directory: str, step: int) -> dict:
  """The JSON metadata of one checkpoint, read without starting JAX.

  Raises CorruptCheckpoint, naming the file and what is wrong, unless it has
  everything a restore relies on.
  """
  where = os.path.join(directory, str(step))
  path = os.path.join(where, 'meta', 'metadata')  # the file ocp.args.JsonSave writes
  try:
    with open(path, encoding='utf-8') as f:
      meta = json.load(f)
  except FileNotFoundError as e:
    raise CorruptCheckpoint(f'{where} is corrupted: cannot read {path} ({e.strerror})') from None
  except OSError as e:  # EIO, a timeout, permissions: no evidence the file is damaged
    raise UnreadableCheckpoint(f'{where}: cannot read {path} ({e}); not known to be corrupted, '
                               'so it is left as it is') from None
  except ValueError as e:
    raise CorruptCheckpoint(f'{where} is corrupted: {path} is not valid JSON, truncated or '
                            f'altered ({e})') from None
  problem = _meta_problem(meta, step)
  if problem:
    raise CorruptCheckpoint(f'{where} is corrupted: {path} {problem}')
  return meta


def _meta_problem(meta, step: int) -> str | None:
  """What makes ``meta`` unlike the metadata a save writes, in words; None if nothing."""
  if not isinstance(meta, dict) or meta.get('format') not in FORMATS:
    return (f'is not ringtrain checkpoint metadata (format '
            f'{meta.get("format") if isinstance(meta, dict) else None!r})')
  if meta.get('step') != step:
    return f'records step {meta.get("step")!r}, not {step}'
  arrays, sums = meta.get('arrays'), meta.get('checksums')
  if not all(isinstance(x, dict) for x in (meta.get('model'), arrays, sums)):
    return 'lacks the model config, the array list or the checksums'
  unsummed = sorted(set(arrays) - set(sums))
  if unsummed:
    return f'has no checksum for {len(unsummed)} array(s) ({_some(unsummed)})'
  for name, entry in arrays.items():
    if not (_is_array_entry(entry) and isinstance(sums[name], int)):
      return f'has a malformed entry for {name} ({entry!r}, checksum {sums[name]!r})'
  return None


def _is_array_entry(entry) -> bool:
  """[shape, dtype] with a dtype the checksums cover."""
  if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
          and all(isinstance(d, int) and d >= 0 for d in entry[0])
          and isinstance(entry[1], str)):
    return False
  try:
    return np.dtype(entry[1]).itemsize in (1, 2, 4)
  except TypeError:
    return False


def peek_model_config(path: str) -> dict:
  """The model config stored with the checkpoint at ``path``, read without starting JAX.

  For config files (``configs/finetune.py``), which run before the devices are
  set up.
  """
  return peek_meta(path)['model']


def peek_meta(path: str) -> dict:
  """The metadata of the checkpoint at ``path`` (see :func:`resolve`)."""
  return read_meta(*resolve(path))


def newest_good(steps: list[int], on_corrupt: str, load: Callable[[int], Any],
                set_aside: Callable[[int, CheckpointError], None] | None = None):
  """``(load(step), step)`` for the newest of ``steps`` whose load succeeds.

  ``load`` raising CorruptCheckpoint ends the walk with that error, unless
  ``on_corrupt`` is 'previous': then ``set_aside`` (if given) gets the step and
  the next older one is tried; the oldest failing too ends it.
  """
  for i, step in enumerate(reversed(steps)):
    try:
      return load(step), step
    except CorruptCheckpoint as e:
      if on_corrupt != 'previous' or i == len(steps) - 1:
        hint = RESUME_HINT if on_corrupt != 'previous' and i < len(steps) - 1 else ''
        raise CorruptCheckpoint(f'{e}{hint}') from None
      if set_aside:
        set_aside(step, e)
  raise CheckpointError('no checkpoint to restore')


# --------------------------------------------------------------- a run's

def _manager(directory: str, items: tuple[str, ...], **options) -> ocp.CheckpointManager:
  # The step directory is made in save() itself, not in a background thread: one that
  # cannot be made (permissions) fails there, where Orbax's writer threads would wait
  # for it until their timeout.
  return ocp.CheckpointManager(directory, item_names=items, options=ocp.CheckpointManagerOptions(
      atomicity_options=ATOMICITY, temporary_path_class=StepPath,
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False), **options))


def _reader(directory: str) -> ocp.CheckpointManager:
  """A manager that restores params only: it creates, saves and deletes nothing.

  Not orbax's ``read_only=True``, which logs three absl warnings at every use
  (fine-tuning's init_from, hf-export) about the options it turns off.
  """
  return _manager(directory, ('params',), create=False)


class Checkpointer:
  """Saves and restores one run's TrainState (see the module docstring)."""

  def __init__(self, workdir: str, policy: Checkpoint):
    self.directory, self.policy = directory_of(workdir), policy
    foreign = foreign_entries(self.directory)
    if foreign and jax.process_index() == 0:
      print(f'warning: {self.directory} holds what ringtrain did not write, left as it is: '
            + ', '.join(foreign[:10]) + (f' and {len(foreign) - 10} more' if len(foreign) > 10
                                         else ''))
    # Orbax's clean-up sees only our unfinished saves (StepPath.validate).
    self._mngr = _manager(
        self.directory, ('params', 'opt_state', 'meta'), max_to_keep=policy.keep,
        keep_period=policy.keep_period or None,
        enable_async_checkpointing=policy.async_save, cleanup_tmp_directories=True)
    self._saving = None  # the step of the save started last, until known to be complete
    self._failure = None  # the SaveFailed raised, once

  def steps(self) -> list[int]:
    return complete_steps(self.directory)

  def save(self, state, meta: dict, data_position: dict | None = None) -> None:
    """Starts saving ``state``; returns once its arrays are copied off the devices.

    ``data_position``: the input pipeline's state after the batch of this step
    (trainer/pipeline.py), kept in the metadata's ``data``. Raises SaveFailed
    when this save, or the one before it, failed.
    """
    step = int(state.step)
    self.wait()  # Orbax would wait for the previous save anyway; its failure is that one's
    where = os.path.join(self.directory, str(step))
    if os.path.lexists(where) and not is_unfinished_save(where):
      raise self._failed(step, FileExistsError(
          f'{where} exists and ringtrain did not start it (no {OWN_MARKER}): move it away, '
          'then run the same command to resume'))
    params, opt = flatten(state.params), flatten({'step': state.step, 'opt': state.opt_state})
    if data_position is not None:
      meta = {**meta, 'data': {**meta.get('data', {}), 'position': data_position}}
    meta = {**meta, 'format': FORMAT, 'step': step,
            'arrays': {**describe(params), **describe(opt)},
            'checksums': {**checksums(params), **checksums(opt)}}
    self._saving = step
    try:
      self._mngr.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt),
          meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:  # pylint: disable=broad-except  # Orbax and TensorStore raise anything
      raise self._failed(step, e) from None

  def check(self) -> None:
    """Raises SaveFailed if the last save failed; returns at once while it is running."""
    if self._saving is not None and not self._mngr.is_saving_in_progress():
      self.wait()

  def _failed(self, step: int, error: BaseException) -> SaveFailed:
    """The one-line SaveFailed for the save of ``step`` failing with ``error``."""
    self._saving = None
    steps = [s for s in self.steps() if s != step]
    kept = (f'the last complete checkpoint (step {steps[-1]}) is intact' if steps else
            'no complete checkpoint')
    self._failure = SaveFailed(
        f'checkpoint {step}: saving to {os.path.join(self.directory, str(step))} failed: '
        f'{os_cause(error)}; stopped, {kept}')
    return self._failure

  def restore(self, abstract_state) -> tuple[Any, int]:
    """The newest good checkpoint as a state sharded like ``abstract_state``."""
    return newest_good(self.steps(), self.policy.on_corrupt,
                       lambda step: self._restore(step, abstract_state), self._set_aside)

  def data_position(self, step: int) -> dict:
    """Where the input pipeline continues after checkpoint ``step``.

    Checkpoints from before the position was recorded: the step itself (their
    batches were a function of the step).
    """
    position = read_meta(self.directory, step).get('data', {}).get('position')
    return position if position is not None else {'next_index': step}

  def _set_aside(self, step: int, error: CheckpointError) -> None:
    """Renames a bad checkpoint out of the way (kept for inspection), so it is redone."""
    bad = os.path.join(self.directory, str(step))
    why = 'process 0 could not move it aside'
    if jax.process_index() == 0:
      aside, n = f'{bad}.corrupt', 1
      while os.path.exists(aside):  # the same step went bad before
        aside, n = f'{bad}.corrupt.{n}', n + 1
      try:
        os.replace(bad, aside)
        print(f'warning: {error}; moved it to {aside} and trying the previous checkpoint')
      except OSError as e:  # GCS FUSE, for one, does not rename non-empty directories
        why = f'moving it aside to {aside} failed ({e.strerror or e})'
    ocp.multihost.sync_global_processes(f'ringtrain_set_aside_{step}')  # every process gets here
    if os.path.exists(bad):  # not moved: every process stops, not only process 0
      raise CheckpointError(f'{error}; {why}: move or delete {bad} yourself, then start again')
    self._mngr.reload()

  def _restore(self, step: int, abstract_state):
    where = os.path.join(self.directory, str(step))
    meta = read_meta(self.directory, step)
    opt_like = {'step': abstract_state.step, 'opt': abstract_state.opt_state}
    wanted = {'params': flatten(abstract_state.params), 'opt_state': flatten(opt_like)}
    diff = differences(meta['arrays'], describe({**wanted['params'], **wanted['opt_state']}))
    if diff:  # not corrupt: saved by a run with another optimizer, say; kept as it is
      raise CheckpointError(f'{where} does not fit this run\'s state ({len(diff)} '
                            f'difference(s)): ' + '; '.join(diff[:5]))
    restored = {name: _read(where, self._mngr, step, name, meta, flat)
                for name, flat in wanted.items()}
    rest = unflatten(opt_like, restored['opt_state'])
    return type(abstract_state)(rest['step'], unflatten(abstract_state.params,
                                                        restored['params']), rest['opt'])

  def wait(self) -> None:
    """Blocks until the last save is complete on disk; raises SaveFailed if it failed."""
    step, self._saving = self._saving, None
    if self._failure is not None:  # reported already: the threads it left have ended
      return
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._failed(step, e) from None
    # Orbax may log a failed commit and carry on (its _finalize_checkpoint): the marker tells.
    if (step is not None and jax.process_index() == 0
        and not _is_complete(os.path.join(self.directory, str(step)))):
      raise self._failed(step, FileNotFoundError(
          f'{COMMIT_MARKER} was not written (see the log above)'))

  def close(self) -> None:
    """Ends Orbax's threads; after a failed save, without raising its error again."""
    try:
      self._mngr.close()
    except Exception:  # pylint: disable=broad-except
      if self._failure is None:
        raise


def _read(where: str, mngr, step: int, item: str, meta: dict, wanted: dict) -> dict:
  """Item ``item``'s arrays, verified in their recorded dtypes, then cast as ``wanted``.

  Every array is checked against its checksum, also when the run wants another
  dtype (a bf16 checkpoint fine-tuned in fp32).
  """
  target = {k: jax.ShapeDtypeStruct(v.shape, np.dtype(meta['arrays'][k][1]), sharding=v.sharding)
            for k, v in wanted.items()}
  flat, failed = None, None
  try:  # each process reads its own shards: one may fail where the others do not
    flat = _restore_item(where, mngr, step, item, ocp.args.StandardRestore(target))
  except CheckpointError as e:
    failed = e
  failed = agreed_failure(failed, where)
  if failed:
    raise failed
  _verify(flat, meta, where)
  return {k: v if v.dtype == wanted[k].dtype else v.astype(wanted[k].dtype)
          for k, v in flat.items()}


def agreed_failure(error: CheckpointError | None, where: str) -> CheckpointError | None:
  """The failure every process acts on, given this process's own (None: it read its part).

  In a multi-process run each process learns the worst of all: corrupt if any found damage
  (all set the checkpoint aside together, or all stop), else unreadable if any could not
  read (all stop); one process failing alone would leave the others waiting in the next
  collective.
  """
  if jax.process_count() == 1:
    return error
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  kind = 2 if isinstance(error, CorruptCheckpoint) else 1 if error else 0
  worst = int(np.max(multihost_utils.process_allgather(np.int32(kind))))
  if worst == 2 and not isinstance(error, CorruptCheckpoint):
    return CorruptCheckpoint(f'{where} is corrupted: another process found it damaged '
                             '(its log names the file)')
  if worst == 1 and error is None:
    return UnreadableCheckpoint(f'cannot restore {where}: another process could not read it '
                                '(its log says why; left as it is)')
  return error


def _restore_item(where: str, mngr, step: int, item: str, args) -> dict:
  try:
    return mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]
  except Exception as e:  # pylint: disable=broad-except  # Orbax and TensorStore raise anything
    damaged, cause = _diagnosis(e)
    if damaged:
      raise CorruptCheckpoint(f'{where} is corrupted: {os.path.join(where, item)} is '
                              f'unreadable: {_cause(cause)}') from None
    raise UnreadableCheckpoint(
        f'cannot restore {os.path.join(where, item)}: {_cause(cause, keep_status=True)} (not '
        'known to be corrupted, so it is left as it is)') from None


# Status codes (TensorStore's, XLA's) and words that say the stored bytes are damaged or
# missing; a restore failing otherwise (RESOURCE_EXHAUSTED, UNAVAILABLE, an EIO, a version
# mismatch, ...) may be the machine's or the filesystem's fault, and sets nothing aside.
_DAMAGE_STATUS = re.compile(r'\b(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND): ')
_OTHER_STATUS = re.compile(r'\b(RESOURCE_EXHAUSTED|UNAVAILABLE|DEADLINE_EXCEEDED|PERMISSION_DENIED|'
                           r'UNAUTHENTICATED|CANCELLED|ABORTED): ')
_DAMAGE_WORDS = re.compile(r'checksum|\bcrc|decod|corrupt', re.IGNORECASE)


def _chain(error: BaseException) -> list[BaseException]:
  """``error`` and its causes, outermost first."""
  out = [error]
  while (out[-1].__cause__ or out[-1].__context__) and len(out) < 100:
    out.append(out[-1].__cause__ or out[-1].__context__)
  return out


def _diagnosis(error: BaseException) -> tuple[bool, BaseException]:
  """(whether a restore's error is evidence of damaged files, the error that says so).

  The outermost error of a kind or status that tells decides (an out-of-memory raised
  while Orbax handled a missing optional file is no missing file); failing that, words
  (a checksum, CRC or decoding failure); failing that, it is no evidence.
  """
  chain = _chain(error)
  for e in chain:
    if (isinstance(e, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError))
        or _DAMAGE_STATUS.search(str(e))):
      return True, e
    if (isinstance(e, (MemoryError, PermissionError, TimeoutError, ConnectionError))
        or _OTHER_STATUS.search(str(e))):
      return False, e
  worded = [e for e in chain if _DAMAGE_WORDS.search(str(e))]
  return (True, worded[-1]) if worded else (False, chain[-1])


def os_cause(error: BaseException) -> str:
  """The operating system's words for a failed write, naming the file (one line).

  The innermost OSError of ``error``'s chain (what Orbax or TensorStore wrapped),
  else the error in its words.
  """
  found = [e for e in _chain(error) if isinstance(e, OSError) and e.strerror]
  if not found:
    return _cause(_chain(error)[-1], keep_status=True)
  e = found[-1]
  return f'{e.strerror} ({e.filename})' if e.filename else e.strerror


def _cause(error: BaseException, keep_status: bool = False) -> str:
  """An error in its words (not TensorStore's spec dump), its status code kept or not."""
  text = (str(error).splitlines() or [''])[0]
  if not keep_status:
    text = re.sub(r'^[A-Z_]+: ', '', text)  # TensorStore's status code (DATA_LOSS: ...)
  if isinstance(error, json.JSONDecodeError):
    return f'a JSON file in it is truncated or altered ({text})'
  return (text or type(error).__name__)[:300]


# ---------------------------------------------------------- params only

def restore_params(path: str, abstract_params):
  """Parameters only from the checkpoint at ``path``, sharded like ``abstract_params``.

  Raises CheckpointError listing every parameter whose name or shape differs.
  """
  directory, step = resolve(path)
  meta = read_meta(directory, step)
  wanted = flatten(abstract_params)
  where = os.path.join(directory, str(step))
  diff = differences({k: v for k, v in meta['arrays'].items() if not is_optimizer(k)},
                     describe(wanted))
  if diff:
    more = f'; and {len(diff) - 20} more' if len(diff) > 20 else ''
    raise CheckpointError(f'{where} does not fit the model ({len(diff)} difference(s)): '
                          + '; '.join(diff[:20]) + more)
  with _reader(directory) as mngr:
    flat = _read(where, mngr, step, 'params', meta, wanted)
  return unflatten(abstract_params, flat)


def is_optimizer(name: str) -> bool:
  """Whether a stored name belongs to the optimizer item (step, optimizer state)."""
  return name == 'step' or name.startswith('opt.')


def write_params(directory: str, params, model_config: dict, *, source: str = '') -> str:
  """Writes parameters alone as a checkpoint (step 0) that ``init_from`` loads.

  ``params`` is a nested dict of arrays shaped like
  ``nnx.to_pure_dict(nnx.state(Transformer(...)))``; returns the step directory.
  """
  flat = {k: jnp.asarray(v) for k, v in flatten(params).items()}
  meta = {'format': FORMAT, 'step': 0, 'model': model_config, 'source': source,
          'arrays': describe(flat), 'checksums': checksums(flat)}
  with _manager(directory_of(directory), ('params', 'meta'),
                enable_async_checkpointing=False) as mngr:
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
  with _reader(directory) as mngr:
    flat = _restore_item(where, mngr, step, 'params',
                         ocp.args.PyTreeRestore(restore_args=as_numpy))
  _verify({k: jnp.asarray(v) for k, v in flat.items()}, meta, where)
  nested: dict = {}
  for name, value in flat.items():
    node = nested
    *parents, leaf = name.split('.')
    for part in parents:
      node = node.setdefault(int(part) if part.isdigit() else part, {})
    node[int(leaf) if leaf.isdigit() else leaf] = np.asarray(value)
  return meta['model'], nested
