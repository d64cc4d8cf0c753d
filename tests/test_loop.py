"""The loop's dispatch: one step queued while the host reads the previous one's metrics."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.test_cli import DEFAULT, TINY
from trainer import loop, train

STEPS = ['--config.steps=4', '--config.log_every=1', '--config.eval_every=0',
         '--config.checkpoint.every=0']

# Records, in order, each train-step dispatch and each read of a step's metrics.
TRACE = r'''
import json, sys
from trainer import loop, train
events, read, run_loop = [], loop._read, loop._loop

def traced_loop(run, s, train_step, *rest):
  def step(state, batch):
    events.append('dispatch')
    return train_step(state, batch)
  return run_loop(run, s, step, *rest)

def traced_read(out):
  events.append('read')
  return read(out)

loop._loop, loop._read = traced_loop, traced_read
assert train.main(sys.argv[1:]) == 0
print('EVENTS', json.dumps(events))
'''


def test_one_cpu_device_dispatches_step_k_plus_1_before_reading_step_k(tmp_path):
  """No collectives on one device, so the loop overlaps as on a TPU or GPU."""
  workdir = tmp_path / 'run'
  env = dict(os.environ, PYTHONPATH=ROOT, RINGTRAIN_CPU_DEVICES='1')
  cmd = [sys.executable, '-c', TRACE, '--config', DEFAULT, '--workdir', str(workdir), *TINY,
         *STEPS, '--config.mesh.data=1', '--config.mesh.tensor=1']
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  events = json.loads(proc.stdout.split('EVENTS ')[-1])
  # step 2 dispatched, then step 1 read; ...; the last step is read at once (eval, end)
  assert events == ['dispatch', 'dispatch', 'read', 'dispatch', 'read', 'dispatch', 'read',
                    'read']
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3, 4]  # logged one step late


def test_eight_cpu_devices_wait_for_every_step(tmp_path, monkeypatch):
  """XLA's CPU collectives have deadlocked with several sharded steps queued."""
  events, read, run_loop = [], loop._read, loop._loop

  def traced_loop(run, s, train_step, *rest):
    assert not loop.overlaps_steps(run.mesh)
    return run_loop(run, s, lambda *a: events.append('dispatch') or train_step(*a), *rest)

  monkeypatch.setattr(loop, '_loop', traced_loop)
  monkeypatch.setattr(loop, '_read', lambda out: events.append('read') or read(out))
  assert train.main(['--config', DEFAULT, '--workdir', str(tmp_path), *TINY, *STEPS]) == 0
  assert events == ['dispatch', 'read'] * 4
