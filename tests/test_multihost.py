"""Real multi-process runs on localhost: jax.distributed, gloo, launch.local."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.test_cli import DEFAULT, TINY
from trainer import checkpoint

RUN = TINY + ['--config.log_every=1', '--config.eval_every=0',
              '--config.parallelism.collective_matmul=always']
TRAIN = [sys.executable, '-m', 'trainer.train', '--config', DEFAULT]


def _env(**extra):
  env = {**os.environ, 'PYTHONUNBUFFERED': '1', **extra}
  env.pop('RINGTRAIN_CPU_DEVICES', None)
  return {**env, **extra}


def _launch(workdir, *overrides, processes=2, timeout=300):
  """launch.local with 2 processes x 4 devices; returns (status, output)."""
  cmd = [sys.executable, '-m', 'launch.local', '--num_processes', str(processes), '--',
         *TRAIN, '--workdir', str(workdir), *RUN, *overrides]
  done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                        timeout=timeout, check=False)
  return done.returncode, done.stdout + done.stderr


def _single(capsys, workdir, *overrides):
  """One process, 8 devices: trainer.train's main in this (pytest's) process, which skips a
  new interpreter's imports; returns (status, output)."""
  from trainer import train  # pylint: disable=import-outside-toplevel
  capsys.readouterr()
  code = train.main(['--config', DEFAULT, '--workdir', str(workdir), *RUN, *overrides])
  out = capsys.readouterr()
  return code, out.out + out.err


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {r['step']: r['loss'] for r in map(json.loads, f) if 'loss' in r}


def test_checkpoints_move_between_two_processes_and_one(tmp_path, capsys):
  """Two processes train like one, and on a prepared corpus each run's checkpoint resumes in
  the other, its shuffled batches continuing where the other run stopped. The one-process
  runs are trainer.train's main in this process (_single), the two-process ones launch.local."""
  from trainer import data, prepare  # pylint: disable=import-outside-toplevel
  corpus = str(tmp_path / 'corpus')
  assert prepare.main(['--input', *data.default_corpus_files()[:40], '--output', corpus,
                       '--eval_fraction', '0.25', '--workers', '1']) == 0
  steps = ['--config.steps=6', '--config.checkpoint.every=3', f'--config.data.path={corpus}']
  code, out = _launch(tmp_path / 'a', *steps, '--config.stop_after=3')
  assert code == 0, out
  assert '(2 process(es))' in out and '[p1]' in out
  assert os.path.exists(tmp_path / 'a' / 'logs' / 'process_1.log')
  code, out = _single(capsys, tmp_path / 'a', *steps)  # written by 2 processes, resumed by 1
  assert code == 0 and 'resuming from step 3' in out, out
  code, out = _single(capsys, tmp_path / 'b', *steps, '--config.stop_after=3')
  assert code == 0, out
  code, out = _launch(tmp_path / 'b', *steps)  # written by 1 process, resumed by 2
  assert code == 0 and 'resuming from step 3' in out, out
  a, b = _losses(tmp_path / 'a'), _losses(tmp_path / 'b')
  assert list(a) == list(b) == list(range(1, 7))  # steps 1-3: two processes (a), one (b)
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)
  directory = checkpoint.directory_of(tmp_path / 'a')
  assert checkpoint.complete_steps(directory)[-1] == 6
  assert checkpoint.read_meta(directory, 6)['data']['position'] == {'next_index': 6}


def test_a_locked_workdir_refuses_every_process(tmp_path):
  """Only process 0 takes the lock; the others learn its answer and exit 2 too."""
  from tests.test_cli import LOCK_HOLDER  # pylint: disable=import-outside-toplevel
  holder = subprocess.Popen([sys.executable, '-c', LOCK_HOLDER, str(tmp_path / 'run')],
                            cwd=ROOT, env=_env(PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    code, out = _launch(tmp_path / 'run', '--config.steps=1')
  finally:
    holder.kill()
    holder.wait()
  assert code != 0, out
  assert f'[p0] error: {tmp_path / "run"} is in use by another run (pid {holder.pid}' in out
  # Process 1 says the same, unless the launcher stopped it first (it stops the
  # others once one exits non-zero; under load that can come before its line).
  assert 'Traceback' not in out and 'exited with status 2' in out


def test_every_process_that_fails_by_itself_is_heard(tmp_path):
  """Process 1 fails at once, process 0 a moment later with its own message: the launcher
  lets it say so before stopping it, and forwards the line."""
  late = ('import os, sys, time; i = os.environ["RINGTRAIN_PROCESS_ID"]; '
          'time.sleep(0.6 if i == "0" else 0); print("failing", i); sys.exit(2)')
  done = subprocess.run([sys.executable, '-m', 'launch.local', '--num_processes', '2',
                         '--devices_per_process', '1', '--', sys.executable, '-c', late,
                         '--workdir', str(tmp_path / 'run')], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=60, check=False)
  assert done.returncode == 2
  assert '[p0] failing 0' in done.stdout and '[p1] failing 1' in done.stdout, done.stdout


def _children(pid: int) -> list[int]:
  with open(f'/proc/{pid}/task/{pid}/children') as f:
    return [int(p) for p in f.read().split()]


def _process_id(pid: int) -> str:
  with open(f'/proc/{pid}/environ', 'rb') as f:
    env = dict(v.split(b'=', 1) for v in f.read().split(b'\0') if b'=' in v)
  return env.get(b'RINGTRAIN_PROCESS_ID', b'').decode()


def test_launcher_exits_nonzero_soon_after_a_process_dies(tmp_path):
  cmd = [sys.executable, '-m', 'launch.local', '--num_processes', '2', '--',
         *TRAIN, '--workdir', str(tmp_path / 'run'), *RUN, '--config.steps=100000',
         '--config.checkpoint.every=0']
  launcher = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
  for line in launcher.stdout:
    if line.startswith('[p0] step'):
      break
  victim = next(p for p in _children(launcher.pid) if _process_id(p) == '1')
  os.kill(victim, signal.SIGKILL)
  out = launcher.communicate(timeout=90)[0]
  assert launcher.returncode != 0
  assert 'process 1 exited with status -9' in out and 'last lines of' in out


def test_a_process_alone_notices_its_dead_peer(tmp_path):
  """Without the launcher, the survivor exits non-zero once heartbeats stop."""
  env = lambda i: _env(RINGTRAIN_COORDINATOR='127.0.0.1:' + str(_port()),
                       RINGTRAIN_NUM_PROCESSES='2', RINGTRAIN_PROCESS_ID=str(i),
                       RINGTRAIN_CPU_DEVICES='4')
  first = env(0)
  second = {**env(1), 'RINGTRAIN_COORDINATOR': first['RINGTRAIN_COORDINATOR']}
  cmd = [*TRAIN, '--workdir', str(tmp_path / 'run'), *RUN, '--config.steps=100000',
         '--config.checkpoint.every=0', '--config.distributed.heartbeat_timeout=10']
  procs = [subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for e in (first, second)]
  for line in procs[0].stdout:
    if line.startswith('step'):
      break
  else:  # a survivor that never trained would exit non-zero for another reason
    procs[1].kill()
    pytest.fail(f'process 0 exited with {procs[0].wait()} before its first step')
  procs[1].kill()
  procs[0].communicate(timeout=90)
  assert procs[0].returncode != 0
  procs[1].wait()


def _port():
  from launch import local  # pylint: disable=import-outside-toplevel
  return local.free_port()


def test_launch_local_reads_the_command_as_the_trainer_does(tmp_path, monkeypatch, capsys):
  """``--config.k v`` as trainer.train reads it; a value the trainer would refuse is one line
  and exit 2 before anything starts or is written (no logs/ left in the workdir)."""
  from launch import local  # pylint: disable=import-outside-toplevel
  started = []
  monkeypatch.setattr(local, 'launch', lambda *a: started.append(a) or 0)
  run = tmp_path / 'run'
  base = ['--num_processes', '2', '--', *TRAIN, '--workdir', str(run)]
  assert local.main([*base, '--config.mesh.data', '2', '--config.mesh.tensor', '1',
                     '--config.steps', '3']) == 0
  assert started[0][:2] == (2, 1)  # data=2 x tensor=1: one device each
  assert os.path.isdir(run / 'logs')
  run = tmp_path / 'bad'
  base = ['--num_processes', '2', '--', *TRAIN, '--workdir', str(run)]
  for bad, message in ((['--config.steps', '0'], 'steps=0 must be at least 1'),
                       (['--config.optimizer.warmup_steps=-1'], 'warmup_steps=-1'),
                       (['--config.no_such_key', '1'], 'unknown config key: config.no_such_key')):
    assert local.main([*base, *bad]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith('error: ') and message in err, err
  assert len(started) == 1 and not run.exists()
  (tmp_path / 'file').write_text('')
  assert local.main(['--num_processes', '1', '--devices_per_process', '1', '--', 'true',
                     '--workdir', str(tmp_path / 'file')]) == 2
  assert capsys.readouterr().err.startswith(f'error: cannot make {tmp_path / "file" / "logs"}')
  with pytest.raises(SystemExit) as e:
    local.main(['--num_processes', '2', '--devices_per_process', '0', '--', 'true'])
  assert e.value.code == 2
  assert capsys.readouterr().err == 'error: --devices_per_process=0 must be at least 1\n'
  missing = tmp_path / 'no_such_program'  # was a FileNotFoundError traceback, exit 1
  assert local.main(['--num_processes', '2', '--devices_per_process', '1', '--', str(missing),
                     '--workdir', str(tmp_path / 'missing')]) == 2
  assert capsys.readouterr().err == (f'error: {missing}: no such program (not on PATH, or not '
                                     'executable)\n')
  assert len(started) == 1 and not (tmp_path / 'missing').exists()
  assert local.trainer_args(['python', '-m', 'trainer.train', '--config=a.py', '--workdir', 'w',
                             '--config.steps', '10', '--config.seed=1', '--config', 'b.py']) == (
                                 'b.py', 'w', ['--config.steps', '10', '--config.seed=1'])


def test_bad_distributed_settings_exit_2(tmp_path, capsys):
  from trainer import train  # pylint: disable=import-outside-toplevel
  code = train.main(['--config', DEFAULT, '--workdir', str(tmp_path / 'x'),
                     '--config.distributed.num_processes=2'])
  assert code == 2
  assert 'need an address host:port' in capsys.readouterr().err


def test_tpu_pod_dry_run_prints_worker_all_commands(capsys):
  from launch import tpu_pod  # pylint: disable=import-outside-toplevel
  code = tpu_pod.main(['--tpu', 'my-v4', '--zone', 'us-central2-b', '--project', 'proj',
                       '--dry_run', '--', 'python', '-m', 'trainer.train', '--config',
                       'configs/dense_10b.py'])
  out = capsys.readouterr().out
  assert code == 0
  ssh = [l for l in out.splitlines() if 'tpu-vm ssh' in l]
  assert ssh and all('--worker=all' in l and 'my-v4' in l and '--zone=us-central2-b' in l
                     and '--project=proj' in l for l in ssh)
  assert any('trainer.train' in l and 'distributed.auto=True' in l for l in ssh)
  assert any('tpu-vm scp' in l for l in out.splitlines())
  code = tpu_pod.main(['--tpu', 'my-v4', '--zone', 'us-central2-b', '--dry_run', '--stop'])
  assert code == 0 and 'pkill' in capsys.readouterr().out
