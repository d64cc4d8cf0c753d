"""Checkpoints: exact resume, preemption, faults, and parameters onto other meshes."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import ROOT
from tests.test_cli import DEFAULT, TINY
from trainer import checkpoint, evaluate, loop, train

# Tiny runs that log every step; checkpoints every 2 steps.
RUN = TINY + ['--config.log_every=1', '--config.eval_every=0', '--config.checkpoint.every=2']


def _main(workdir, *overrides):
  return train.main(['--config', DEFAULT, '--workdir', str(workdir), *RUN, *overrides])


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {r['step']: r['loss'] for r in map(json.loads, f) if 'loss' in r}


def _params_equal(a, b):
  a, b = checkpoint.read_params(a)[1], checkpoint.read_params(b)[1]
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _cli(workdir, *overrides, env=None, **kwargs):
  cmd = [sys.executable, '-m', 'trainer.train', '--config', DEFAULT, '--workdir', str(workdir),
         *RUN, *overrides]
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, 'PYTHONUNBUFFERED': '1', **(env or {})}, **kwargs)


def test_stop_and_resume_is_bit_exact(tmp_path, capsys):
  assert _main(tmp_path / 'straight', '--config.steps=8', '--config.checkpoint.keep=2',
               '--config.checkpoint.keep_period=4') == 0
  # the newest two, plus those divisible by keep_period
  assert checkpoint.complete_steps(checkpoint.directory_of(tmp_path / 'straight')) == [4, 6, 8]
  assert _main(tmp_path / 'split', '--config.steps=8', '--config.stop_after=4') == 0
  assert 'run the same command without stop_after' in capsys.readouterr().out
  assert checkpoint.complete_steps(checkpoint.directory_of(tmp_path / 'split')) == [2, 4]
  assert _main(tmp_path / 'split', '--config.steps=8') == 0
  assert 'resuming from step 4' in capsys.readouterr().out
  straight, split = _losses(tmp_path / 'straight'), _losses(tmp_path / 'split')
  assert list(split) == list(range(1, 9))
  assert split == straight  # every step's loss, exactly
  assert _params_equal(tmp_path / 'straight', tmp_path / 'split')
  assert _main(tmp_path / 'split', '--config.steps=8') == 0  # nothing left to do
  assert 'already at step 8' in capsys.readouterr().out


def test_resume_refuses_another_model(tmp_path, capsys):
  assert _main(tmp_path / 'run', '--config.steps=4', '--config.stop_after=2') == 0
  capsys.readouterr()
  assert _main(tmp_path / 'run', '--config.steps=4', '--config.model.mlp_dim=128') == 2
  err = capsys.readouterr().err.strip()
  assert '\n' not in err
  assert 'has checkpoints of another run (model.mlp_dim: 64 in the checkpoint, 128 now)' in err
  # Other data would not continue the batches the checkpoint's position counts.
  assert _main(tmp_path / 'run', '--config.steps=4', '--config.data.path=synthetic') == 2
  err = capsys.readouterr().err.strip()
  assert "(data path: '' in the checkpoint, 'synthetic' now; data tokens: " in err, err
  # A larger held-out split would move tokens between training and evaluation.
  assert _main(tmp_path / 'run', '--config.steps=4', '--config.data.eval_fraction=0.2') == 2
  err = capsys.readouterr().err.strip()
  assert 'data eval_fraction: 0.1 in the checkpoint, 0.2 now' in err, err


def test_init_from_loads_params_only_onto_another_mesh(tmp_path):
  assert _main(tmp_path / 'src', '--config.steps=2') == 0
  saved = checkpoint.read_params(tmp_path / 'src')[1]
  run = train.prepare(*train.parse_args([
      '--config', DEFAULT, '--workdir', str(tmp_path / 'ft'), *RUN, '--config.steps=2',
      f'--config.init_from={tmp_path / "src"}', '--config.mesh.data=1',
      '--config.mesh.fsdp=4', '--config.mesh.tensor=2']))
  s = loop.setup(run)
  assert s.start_step == 0 and int(s.state.step) == 0
  loaded = nnx.to_pure_dict(s.state.params)
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(a, np.asarray(b))  # same values, other sharding
  q = checkpoint.flatten(s.state.params)['blocks.0.attn.q_dnh']
  assert q.sharding.spec[0] == 'fsdp'
  moments = {k: v for k, v in checkpoint.flatten(s.state.opt_state).items() if '.mu.' in k}
  assert moments and all(not np.any(np.asarray(m)) for m in moments.values())  # fresh


def test_init_from_onto_one_device_trains_like_eight(tmp_path):
  assert _main(tmp_path / 'src', '--config.steps=2') == 0
  init = [f'--config.init_from={tmp_path / "src"}', '--config.steps=1']
  assert _main(tmp_path / 'eight', *init) == 0
  one = _cli(tmp_path / 'one', *init, '--config.mesh.data=1', '--config.mesh.tensor=1',
             env={'RINGTRAIN_CPU_DEVICES': '1'})
  out = one.communicate(timeout=300)[0]
  assert one.returncode == 0, out
  assert 'parameters loaded from' in out
  np.testing.assert_allclose(_losses(tmp_path / 'one')[1], _losses(tmp_path / 'eight')[1],
                             rtol=1e-5)


@pytest.mark.parametrize('target, message', [
    ('{tmp}/nowhere', 'no such checkpoint path'),
    ('{tmp}', 'is not a checkpoint'),
    ('{src}', 'parameter(s) differ from the model'),
])
def test_bad_init_from_exits_2_with_one_line(tmp_path, capsys, target, message):
  if '{src}' in target:
    assert _main(tmp_path / 'src', '--config.steps=1', '--config.model.d_model=64') == 0
  capsys.readouterr()
  path = target.format(tmp=tmp_path, src=tmp_path / 'src')
  code = _main(tmp_path / 'ft', '--config.steps=1', f'--config.init_from={path}')
  err = capsys.readouterr().err.strip()
  assert code == 2 and '\n' not in err and message in err, err
  assert not (tmp_path / 'ft').exists()
  if '{src}' in target:
    assert 'embed_vd: shape (264, 64) in the checkpoint, (264, 32) in the model' in err


def corrupt_params(step_dir) -> None:
  """Flips a byte in the middle of every parameter data file of a checkpoint's step."""
  paths = glob.glob(os.path.join(step_dir, 'params', '**', 'd', '*'), recursive=True)
  assert paths, step_dir
  for path in paths:
    with open(path, 'r+b') as f:
      f.seek(os.path.getsize(path) // 2)
      byte = f.read(1)
      f.seek(-1, 1)
      f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupted_checkpoint_is_named_and_can_fall_back(tmp_path, capsys):
  assert _main(tmp_path / 'run', '--config.steps=6', '--config.stop_after=4') == 0
  step4 = os.path.join(checkpoint.directory_of(tmp_path / 'run'), '4')
  corrupt_params(step4)
  capsys.readouterr()
  assert _main(tmp_path / 'run', '--config.steps=6') == 1
  err = capsys.readouterr().err.strip()
  assert '\n' not in err and step4 in err and 'on_corrupt=previous' in err, err
  assert evaluate.main(['--checkpoint', str(tmp_path / 'run')]) == 1  # found when restoring
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and '\n' not in err and step4 in err, err
  assert _main(tmp_path / 'run', '--config.steps=6', '--config.checkpoint.on_corrupt=previous') == 0
  assert 'resuming from step 2' in capsys.readouterr().out


def test_truncated_checkpoint_is_named(tmp_path, capsys):
  assert _main(tmp_path / 'run', '--config.steps=4', '--config.stop_after=2') == 0
  step2 = os.path.join(checkpoint.directory_of(tmp_path / 'run'), '2')
  for path in glob.glob(os.path.join(step2, 'opt_state', '**', 'd', '*'), recursive=True):
    os.truncate(path, os.path.getsize(path) // 2)
  capsys.readouterr()
  assert _main(tmp_path / 'run', '--config.steps=4') == 1
  err = capsys.readouterr().err.strip()
  assert '\n' not in err and f'{step2}/opt_state is unreadable: ' in err, err
  assert '<bound method' not in err and 'TensorStore' not in err  # the cause, in words


def _break_meta(src, dst, edit):
  """A copy of workdir ``src`` whose newest checkpoint's metadata ``edit`` changes."""
  shutil.copytree(src, dst)
  directory = checkpoint.directory_of(dst)
  path = os.path.join(directory, str(checkpoint.complete_steps(directory)[-1]), 'meta',
                      'metadata')
  with open(path, encoding='utf-8') as f:
    meta = json.load(f)
  text = edit(meta)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text if isinstance(text, str) else json.dumps(meta))
  return path


def test_broken_metadata_is_corrupt_and_can_fall_back(tmp_path, capsys):
  assert _main(tmp_path / 'run', '--config.steps=4') == 0  # checkpoints 2 and 4
  cases = {  # how the metadata breaks -> what the one line says
      'truncated': (lambda m: json.dumps(m)[:100], 'is not valid JSON, truncated or altered'),
      'no_checksum': (lambda m: m['checksums'].pop('embed_vd'),
                      'has no checksum for 1 array(s) (embed_vd)'),
      'retyped': (lambda m: m['arrays']['embed_vd'].__setitem__(1, 'float16'),
                  'fail their checksum (embed_vd)'),
  }
  for name, (edit, message) in cases.items():
    path = _break_meta(tmp_path / 'run', tmp_path / name, edit)
    capsys.readouterr()
    assert _main(tmp_path / name, '--config.steps=6') == 1, name
    err = capsys.readouterr().err.strip()
    assert '\n' not in err and message in err and 'on_corrupt=previous' in err, err
    assert (path if name != 'retyped' else os.path.dirname(os.path.dirname(path))) in err
  assert _main(tmp_path / 'truncated', '--config.steps=6', '--config.stop_after=3',
               '--config.checkpoint.on_corrupt=previous') == 0
  out = capsys.readouterr().out
  assert 'moved it to' in out and 'resuming from step 2' in out
  assert os.path.isdir(os.path.join(checkpoint.directory_of(tmp_path / 'truncated'), '4.corrupt'))


def test_only_orbax_commit_marker_makes_a_checkpoint_complete(tmp_path):
  assert _main(tmp_path / 'run', '--config.steps=2') == 0
  directory = checkpoint.directory_of(tmp_path / 'run')
  assert checkpoint.complete_steps(directory) == [2]
  os.remove(os.path.join(directory, '2', 'commit_success.txt'))  # all else is there
  assert checkpoint.complete_steps(directory) == []


def test_an_update_that_overflows_is_never_saved(tmp_path, capsys):
  """1e39 is inf in float32: step 1's loss (before the update) is finite, its result not."""
  assert _main(tmp_path / 'run', '--config.optimizer.learning_rate=1e39',
               '--config.optimizer.warmup_steps=0', '--config.checkpoint.every=1',
               '--config.steps=3') == 3
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: step 1: the update made parameters or optimizer state '
                        'non-finite') and 'stopped, no checkpoint' in err, err
  assert checkpoint.complete_steps(checkpoint.directory_of(tmp_path / 'run')) == []


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path, capsys):
  diverge = ['--config.optimizer.learning_rate=1e12', '--config.optimizer.warmup_steps=0',
             '--config.optimizer.grad_clip=0.0', '--config.checkpoint.every=1',
             '--config.steps=6']
  assert _main(tmp_path / 'run', *diverge) == 3
  err = capsys.readouterr().err.strip()
  bad = int(err.split('step ')[1].split(':')[0])
  assert 'loss is' in err and f'the last checkpoint (step {bad - 1}) is intact' in err, err
  directory = checkpoint.directory_of(tmp_path / 'run')
  assert checkpoint.complete_steps(directory)[-1] == bad - 1
  params = checkpoint.read_params(os.path.join(directory, str(bad - 1)))[1]
  assert all(np.isfinite(p).all() for p in jax.tree.leaves(params))
  # skip: the run finishes, dropping the non-finite updates and counting them.
  assert _main(tmp_path / 'skip', *diverge, '--config.on_nonfinite=skip') == 0
  with open(tmp_path / 'skip' / 'metrics.jsonl') as f:
    assert sum(r.get('skipped', 0) for r in map(json.loads, f)) >= 1


def test_sigterm_saves_then_exits_and_resumes(tmp_path):
  proc = _cli(tmp_path / 'run', '--config.steps=400', '--config.checkpoint.every=1000')
  for line in proc.stdout:
    if line.startswith('step') and '/400' in line:
      proc.send_signal(signal.SIGTERM)
      break
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 143, out
  stopped = int(out.split('stopped by SIGTERM after step ')[1].split(';')[0])
  assert checkpoint.complete_steps(checkpoint.directory_of(tmp_path / 'run')) == [stopped]
  resumed = _cli(tmp_path / 'run', '--config.steps=400', '--config.checkpoint.every=1000',
                 f'--config.stop_after={stopped + 1}')
  out = resumed.communicate(timeout=300)[0]
  assert resumed.returncode == 0 and f'resuming from step {stopped}' in out, out


# Runs trainer.train with Orbax's commit of checkpoint 2 held back: that save's files are
# written, its commit marker is not, and the file named by argv[1] says so.
PAUSE_BEFORE_COMMIT_2 = r'''
import asyncio, sys
from orbax.checkpoint._src.path import atomicity
from trainer import train
marker, commit = sys.argv[1], atomicity.CommitFileTemporaryPath.finalize

async def paused(self):
  if self.get_final().name == '2':
    open(marker, 'w').close()
    await asyncio.sleep(3600)  # until killed
  return await commit(self)

atomicity.CommitFileTemporaryPath.finalize = paused
sys.exit(train.main(sys.argv[2:]))
'''


def test_sigkill_during_async_save_resumes_from_last_complete(tmp_path):
  """Kills the trainer while a checkpoint is written (paused before its commit, not raced);
  the next start removes it and resumes from the last complete one."""
  directory, marker = checkpoint.directory_of(tmp_path / 'run'), tmp_path / 'paused'
  every = ['--config.steps=4', '--config.checkpoint.every=1']
  proc = subprocess.Popen(
      [sys.executable, '-c', PAUSE_BEFORE_COMMIT_2, str(marker), '--config', DEFAULT,
       '--workdir', str(tmp_path / 'run'), *RUN, *every], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
  for _ in range(6000):  # a guard against a hang, not a timing: the pause is waited for
    if marker.exists() or proc.poll() is not None:
      break
    time.sleep(0.05)
  if not marker.exists():
    proc.kill()
    pytest.fail('checkpoint 2 never reached its commit: ' + proc.communicate()[0][-3000:])
  assert checkpoint.complete_steps(directory) == [1] and _uncommitted(directory) == ['2']
  proc.kill()
  proc.communicate(timeout=60)
  # No save in the resumed run, which would write step 2 over the leftover.
  resumed = _cli(tmp_path / 'run', '--config.steps=4', '--config.checkpoint.every=0',
                 '--config.stop_after=2')
  out = resumed.communicate(timeout=300)[0]
  assert resumed.returncode == 0 and 'resuming from step 1' in out, out
  assert os.listdir(directory) == ['1']  # the leftover removed at the start


def _uncommitted(directory):
  """Step directories a save has started and not committed (written in place)."""
  names = os.listdir(directory) if os.path.isdir(directory) else []
  complete = set(checkpoint.complete_steps(directory))
  return [d for d in names if d.isdigit() and int(d) not in complete]


def test_hf_import_then_fine_tune(tmp_path, capsys):
  """A Llama made by transformers, imported, fine-tuned through configs/finetune.py."""
  transformers = pytest.importorskip('transformers')
  from trainer import convert  # pylint: disable=import-outside-toplevel
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
  hf.save_pretrained(tmp_path / 'hf', safe_serialization=True)
  assert convert.main(['hf-import', '--hf_dir', str(tmp_path / 'hf'),
                       '--out_dir', str(tmp_path / 'imported')]) == 0
  finetune = os.path.join(ROOT, 'configs', 'finetune.py')
  code = train.main(['--config', f'{finetune}:{tmp_path / "imported"}', '--workdir',
                     str(tmp_path / 'ft'), '--config.steps=3', '--config.batch_size=8',
                     '--config.seq_len=32', '--config.eval_steps=1', '--config.log_every=1',
                     '--config.mesh.data=4', '--config.mesh.tensor=2'])
  assert code == 0
  assert 'parameters loaded from' in capsys.readouterr().out
  assert len(_losses(tmp_path / 'ft')) == 3
  model, _ = checkpoint.read_params(tmp_path / 'ft')
  assert model['num_kv_heads'] == 2 and model['max_seq_len'] == 64
  # A config that needs a checkpoint says so.
  assert train.main(['--config', finetune, '--workdir', str(tmp_path / 'x')]) == 2
  assert 'needs a checkpoint' in capsys.readouterr().err


# ------------------------------------------------ unit level: tiny arrays, no training

def _tiny_state(step):
  from trainer.step import TrainState  # pylint: disable=import-outside-toplevel
  params = {'w': jax.numpy.arange(8, dtype=jax.numpy.float32) * step, 'b': jax.numpy.ones(3)}
  return TrainState(jax.numpy.int32(step), params, {'mu': {'w': jax.numpy.zeros(8)}})


def _tiny_checkpointer(tmp_path, steps=(1, 2), on_corrupt='previous'):
  """A Checkpointer in ``tmp_path`` holding tiny states at ``steps`` (saved synchronously)."""
  from trainer.config import Checkpoint  # pylint: disable=import-outside-toplevel
  ckpt = checkpoint.Checkpointer(str(tmp_path), Checkpoint(keep=10, async_save=False,
                                                           on_corrupt=on_corrupt))
  for step in steps:
    ckpt.save(_tiny_state(step), {'model': {}})
  ckpt.wait()
  return ckpt


def test_a_restore_failing_for_want_of_memory_sets_nothing_aside(tmp_path, monkeypatch):
  ckpt = _tiny_checkpointer(tmp_path)
  def out_of_memory(*args, **kwargs):
    raise ValueError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 96 bytes')
  monkeypatch.setattr(ckpt._mngr, 'restore', out_of_memory)  # pylint: disable=protected-access
  with pytest.raises(checkpoint.CheckpointError) as raised:
    ckpt.restore(_tiny_state(0))
  assert not isinstance(raised.value, checkpoint.CorruptCheckpoint)
  assert raised.value.exit_status == 1
  message = str(raised.value)
  assert 'RESOURCE_EXHAUSTED: Out of memory' in message, message
  assert os.path.join(ckpt.directory, '2') in message, message
  assert sorted(os.listdir(ckpt.directory)) == ['1', '2']  # nothing set aside
  # Nor an I/O error reading the metadata.
  monkeypatch.setattr(checkpoint.json, 'load', lambda f: (_ for _ in ()).throw(
      OSError(5, 'Input/output error')))
  with pytest.raises(checkpoint.UnreadableCheckpoint, match='Input/output error'):
    ckpt.restore(_tiny_state(0))
  assert sorted(os.listdir(ckpt.directory)) == ['1', '2']
  ckpt.close()


@pytest.mark.parametrize('error, damaged', [
    (ValueError('DATA_LOSS: Error reading "a/.zarray"'), True),
    (ValueError('OUT_OF_RANGE: Error reading byte range'), True),
    (ValueError('NOT_FOUND: Error opening "zarr" driver'), True),
    (FileNotFoundError('No structure could be identified'), True),
    (ValueError('INVALID_ARGUMENT: Error decoding chunk'), True),
    (ValueError('RESOURCE_EXHAUSTED: Out of memory'), False),
    (ValueError('UNAVAILABLE: connection reset'), False),
    (ValueError('DEADLINE_EXCEEDED: read timed out'), False),
    (OSError(5, 'Input/output error'), False),
    (PermissionError(13, 'Permission denied'), False),
    (ValueError('Unsupported checkpoint version 9'), False),
])
def test_only_evidence_of_damage_is_corruption(error, damaged):
  assert checkpoint._diagnosis(error)[0] is damaged  # pylint: disable=protected-access


def test_a_flipped_byte_is_still_corrupt_and_set_aside(tmp_path):
  ckpt = _tiny_checkpointer(tmp_path)
  corrupt_params(os.path.join(ckpt.directory, '2'))
  state, step = ckpt.restore(_tiny_state(0))
  assert step == 1 and int(state.step) == 1
  assert sorted(os.listdir(ckpt.directory)) == ['1', '2.corrupt']
  ckpt.close()


def test_checksum_sees_every_bit_however_sharded(devices):
  x = jax.numpy.arange(1, 17, dtype=jax.numpy.float32)
  signed = x.at[1].multiply(-1)  # the top bit at an odd position
  old = 'ringtrain-checkpoint-1'
  assert checkpoint.checksums({'x': x}, old) == checkpoint.checksums({'x': signed}, old)  # why 2
  assert checkpoint.checksums({'x': x}) != checkpoint.checksums({'x': signed})
  swapped = x.at[jax.numpy.array([0, 1])].set(x[jax.numpy.array([1, 0])])
  assert checkpoint.checksums({'x': x}) != checkpoint.checksums({'x': swapped})
  two = x.at[1].multiply(-1).at[3].multiply(-1)  # two top bits do not cancel
  assert checkpoint.checksums({'x': x}) != checkpoint.checksums({'x': two})
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('d')))
  assert checkpoint.checksums({'x': sharded}) == checkpoint.checksums({'x': np.asarray(x)})


def test_format_1_checkpoints_still_verify(tmp_path):
  ckpt = _tiny_checkpointer(tmp_path)
  state = _tiny_state(2)
  flat = {**checkpoint.flatten(state.params),
          **checkpoint.flatten({'step': state.step, 'opt': state.opt_state})}
  path = os.path.join(ckpt.directory, '2', 'meta', 'metadata')
  with open(path, encoding='utf-8') as f:
    meta = json.load(f)
  assert meta['format'] == checkpoint.FORMAT != 'ringtrain-checkpoint-1'
  meta.update(format='ringtrain-checkpoint-1',
              checksums=checkpoint.checksums(flat, 'ringtrain-checkpoint-1'))
  assert meta['checksums'] != checkpoint.checksums(flat)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(meta, f)
  restored, step = ckpt.restore(_tiny_state(0))
  assert step == 2 and np.array_equal(restored.params['w'], state.params['w'])
  ckpt.close()


def test_a_corrupt_checkpoint_that_cannot_be_moved_stops_the_run(tmp_path, monkeypatch):
  ckpt = _tiny_checkpointer(tmp_path)
  corrupt_params(os.path.join(ckpt.directory, '2'))
  def refuse(src, dst):
    raise OSError(39, 'Directory not empty', src)
  monkeypatch.setattr(checkpoint.os, 'replace', refuse)
  with pytest.raises(checkpoint.CheckpointError) as raised:
    ckpt.restore(_tiny_state(0))
  message = str(raised.value)
  step2 = os.path.join(ckpt.directory, '2')
  assert f'move or delete {step2} yourself' in message and 'Directory not empty' in message, message
  assert f'{step2} is corrupted: ' in message, message
  assert sorted(os.listdir(ckpt.directory)) == ['1', '2']
  ckpt.close()


def test_resolve_a_workdir_named_checkpoints(tmp_path):
  workdir = tmp_path / 'checkpoints'
  _tiny_checkpointer(workdir, steps=(1,)).close()
  inner = os.path.join(workdir, 'checkpoints')
  assert checkpoint.resolve(str(workdir)) == (inner, 1)  # the workdir
  assert checkpoint.resolve(inner) == (inner, 1)  # its checkpoints/
  assert checkpoint.resolve(os.path.join(inner, '1')) == (inner, 1)  # a step


@pytest.mark.parametrize('mine, others, expected', [
    (None, [0], None),                      # every process read its part
    (None, [2], checkpoint.CorruptCheckpoint),     # another found damage: all set it aside
    (None, [1], checkpoint.UnreadableCheckpoint),  # another could not read: all stop
    ('unreadable', [2], checkpoint.CorruptCheckpoint),  # damage wins: the same verdict
    ('corrupt', [1], checkpoint.CorruptCheckpoint),
])
def test_processes_agree_on_a_failed_read(monkeypatch, mine, others, expected):
  """A process that failed alone would leave the others waiting in the next collective."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost_utils, 'process_allgather',
                      lambda x: np.array([int(x)] + others, np.int32))
  own = {None: None, 'unreadable': checkpoint.UnreadableCheckpoint('cannot restore s: OOM'),
         'corrupt': checkpoint.CorruptCheckpoint('s is corrupted: DATA_LOSS')}[mine]
  got = checkpoint.agreed_failure(own, 's')
  assert type(got) is expected if expected else got is None
  if own is not None and isinstance(own, expected):
    assert got is own  # its own message, which names the file
