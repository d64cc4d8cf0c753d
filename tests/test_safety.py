"""Run-time safety: nothing a user owns is deleted, failed saves stop, signals save, nothing hangs."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.conftest import ROOT
from tests.test_checkpoint import RUN, _losses, _main
from tests.test_cli import DEFAULT
from trainer import checkpoint, metrics, runtime, train

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_safety')

STRAIGHT = ['--config.steps=4']


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """The losses of a 4-step run without a stop (checkpoints at steps 2 and 4)."""
  workdir = tmp_path_factory.mktemp('straight')
  assert _main(workdir, *STRAIGHT) == 0
  return _losses(workdir)


def _stopped_at_2(workdir, capsys):
  assert _main(workdir, *STRAIGHT, '--config.stop_after=2') == 0
  capsys.readouterr()
  return checkpoint.directory_of(workdir)


def test_only_ringtrain_saves_are_removed_and_resume_is_exact(tmp_path, capsys, straight):
  directory = _stopped_at_2(tmp_path / 'run', capsys)
  (tmp_path / 'run' / 'checkpoints' / 'my_backup').mkdir()
  (tmp_path / 'run' / 'checkpoints' / 'my_backup' / 'notes.txt').write_text('x\n')
  for name in ('notastep', '-5', '25.tmp', '7'):  # '7': a step's name, not our save
    os.mkdir(os.path.join(directory, name))
    with open(os.path.join(directory, name, 'keep.txt'), 'w') as f:
      f.write(name)
  with open(os.path.join(directory, '99'), 'w') as f:
    f.write('a file named like a step\n')
  ours = os.path.join(directory, '3')  # a save of ours, cut short before its commit
  os.mkdir(ours)
  with open(os.path.join(ours, checkpoint.OWN_MARKER), 'w') as f:
    f.write('x')
  assert _main(tmp_path / 'run', *STRAIGHT) == 0
  out = capsys.readouterr().out
  assert 'resuming from step 2' in out
  warning = [line for line in out.splitlines() if line.startswith('warning: ')]
  assert len(warning) == 1 and 'left as it is: -5, 25.tmp, 7, 99, my_backup, notastep' in (
      warning[0]), out
  assert (tmp_path / 'run' / 'checkpoints' / 'my_backup' / 'notes.txt').read_text() == 'x\n'
  for name in ('notastep', '-5', '25.tmp', '7'):
    with open(os.path.join(directory, name, 'keep.txt')) as f:
      assert f.read() == name
  assert os.path.isfile(os.path.join(directory, '99'))
  assert not os.path.exists(ours)  # ours, unfinished: removed
  assert checkpoint.complete_steps(directory) == [2, 4]
  assert _losses(tmp_path / 'run') == straight  # every step's loss, exactly


def test_a_save_never_replaces_a_step_directory_it_did_not_start(tmp_path, capsys):
  directory = _stopped_at_2(tmp_path / 'run', capsys)
  os.mkdir(os.path.join(directory, '4'))
  with open(os.path.join(directory, '4', 'mine.txt'), 'w') as f:
    f.write('mine')
  assert _main(tmp_path / 'run', *STRAIGHT) == 1
  err = capsys.readouterr().err.strip()
  assert '\n' not in err and f'{directory}/4 exists and ringtrain did not start it' in err, err
  with open(os.path.join(directory, '4', 'mine.txt')) as f:
    assert f.read() == 'mine'
  assert checkpoint.complete_steps(directory) == [2]


def _live_threads():
  return {t for t in threading.enumerate() if t.is_alive() and not t.daemon}


@pytest.mark.parametrize('where', ['background', 'foreground'])
def test_a_failed_save_stops_the_run_keeping_the_last_checkpoint(tmp_path, capsys, monkeypatch,
                                                                  where):
  """Background: the commit of step 4's save fails (a full disk); foreground: its directory
  cannot be made (a read-only checkpoints/)."""
  def fail(path):
    if where == 'background':
      return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f'{path}/commit_success.txt')
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
  method = 'finalize' if where == 'background' else 'create'
  real = getattr(checkpoint.StepPath, method)

  async def failing(self):
    path = os.fspath(self.get())
    if path.endswith(f'{os.sep}4'):
      raise fail(path)
    return await real(self)

  monkeypatch.setattr(checkpoint.StepPath, method, failing)
  before = _live_threads()
  assert _main(tmp_path / 'run', '--config.steps=8') == 1
  captured = capsys.readouterr()
  err = captured.err.strip()
  directory = checkpoint.directory_of(tmp_path / 'run')
  cause = 'No space left on device' if where == 'background' else 'Permission denied'
  assert err.startswith(f'error: checkpoint 4: saving to {directory}/4 failed: {cause} (')
  assert '\n' not in err and 'the last complete checkpoint (step 2) is intact' in err, err
  assert 'Traceback' not in captured.out + captured.err
  # It stopped at the first step boundary that knew: at the latest, the next save's.
  assert max(_losses(tmp_path / 'run')) <= 6
  assert checkpoint.complete_steps(directory) == [2]
  checkpoint.read_params(os.path.join(directory, '2'))  # intact: every checksum verified
  assert _live_threads() <= before  # no thread of the save left behind


def test_resume_drops_a_torn_last_metrics_line(tmp_path, capsys, straight):
  _stopped_at_2(tmp_path / 'run', capsys)
  path = tmp_path / 'run' / 'metrics.jsonl'
  with open(path, 'a') as f:
    f.write('{"step": 3, "loss": 5.8')  # a full disk's partial write
  assert _main(tmp_path / 'run', *STRAIGHT) == 0
  out = capsys.readouterr().out
  assert f'warning: {path}: dropped its last line, cut short' in out, out
  assert _losses(tmp_path / 'run') == straight
  # A damaged line before the last is named before anything compiles, and kept.
  lines = path.read_text().splitlines()
  path.write_text('\n'.join(lines[:1] + ['{"step": 1, "lo'] + lines[1:]) + '\n')
  assert _main(tmp_path / 'run', '--config.steps=6') == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f'error: {path} line 2 is not a metrics record (') and err.endswith(
      '): fix or delete that line, then run the same command again') and '\n' not in err, err


def test_trim_keeps_the_records_up_to_the_step(tmp_path):
  records = [{'step': s, 'loss': 1.0} for s in (1, 2, 3)]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  metrics.trim(str(tmp_path), 2)
  kept = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert kept == records[:2]
  assert os.listdir(tmp_path) == ['metrics.jsonl']  # its temporary is gone


def test_an_earlier_runs_outputs_stay_until_the_first_steps_pass(tmp_path, capsys):
  """A run that fails at its first step (here an update to inf) replaces nothing."""
  assert _main(tmp_path / 'run', '--config.steps=2', '--config.checkpoint.every=0') == 0
  before = {p: (tmp_path / 'run' / p).read_bytes()
            for p in ('metrics.jsonl', 'config.json', 'parallelism_report.json')}
  capsys.readouterr()
  assert _main(tmp_path / 'run', '--config.steps=2', '--config.checkpoint.every=0',
               '--config.optimizer.learning_rate=1e39', '--config.optimizer.warmup_steps=0') == 3
  captured = capsys.readouterr()
  assert 'replacing the outputs' not in captured.out
  assert 'the update made parameters or optimizer state non-finite' in captured.err
  for p, content in before.items():
    assert (tmp_path / 'run' / p).read_bytes() == content, p
  assert _main(tmp_path / 'run', '--config.steps=1', '--config.checkpoint.every=0') == 0
  assert 'replacing the outputs of an earlier run (metrics.jsonl, tb)' in capsys.readouterr().out
  assert list(_losses(tmp_path / 'run')) == [1]


def test_a_full_disk_is_one_line_and_verbose_shows_the_traceback(tmp_path, capsys, monkeypatch):
  def full(self, step, record):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / 'run' / 'x'))
  monkeypatch.setattr(metrics.MetricsWriter, 'write', full)
  args = ['--config', DEFAULT, '--workdir', str(tmp_path / 'run'), *RUN, '--config.steps=1',
          '--config.checkpoint.every=0']
  assert train.main(args) == 1
  err = capsys.readouterr().err.strip()
  assert err == (f'error: No space left on device ({tmp_path / "run" / "x"}) '
                 '(--verbose prints the traceback)'), err
  assert train.main(args + ['--verbose']) == 1
  err = capsys.readouterr().err
  assert 'Traceback (most recent call last)' in err and 'OSError: [Errno 28]' in err


# ---------------------------------------------------------------- signals

def _trainer(workdir, *overrides):
  cmd = [sys.executable, '-m', 'trainer.train', '--config', DEFAULT, '--workdir', str(workdir),
         *RUN, *overrides]
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, 'PYTHONUNBUFFERED': '1'})


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGHUP])
def test_sigint_and_sighup_save_and_stop_like_sigterm(tmp_path, sig):
  proc = _trainer(tmp_path / 'run', '--config.steps=400', '--config.checkpoint.every=1000')
  for line in proc.stdout:
    if line.startswith('step') and '/400' in line:
      proc.send_signal(sig)
      break
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 128 + sig, out
  name = signal.Signals(sig).name
  stopped = int(out.split(f'stopped by {name} after step ')[1].split(';')[0])
  assert 'run the same command to resume' in out and 'Traceback' not in out, out
  assert checkpoint.complete_steps(checkpoint.directory_of(tmp_path / 'run')) == [stopped]


def test_a_second_sigint_is_the_default_one():
  """The first SIGINT asks the loop to save and stop; the second is the kernel's: at once."""
  before = signal.getsignal(signal.SIGINT)  # Python's, or SIG_IGN in a pytest-xdist worker
  with runtime.stop_signals() as stops:
    for sig in runtime.STOP_SIGNALS:
      assert signal.getsignal(sig) == stops.handle  # pylint: disable=comparison-with-callable
    stops.handle(signal.SIGINT, None)
    assert stops.received == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == stops.handle  # pylint: disable=comparison-with-callable
    stops.handle(signal.SIGTERM, None)
    assert stops.received == signal.SIGINT  # the first one counts
  assert signal.getsignal(signal.SIGINT) == before  # pylint: disable=comparison-with-callable


# A launch.local child: says it is ready, then reports the signal it gets and exits 128 + it.
CHILD = r'''
import os, signal, sys, time
i = os.environ['RINGTRAIN_PROCESS_ID']
def stop(signum, frame):
  print(f'child {i} got {signal.Signals(signum).name}', flush=True)
  sys.exit(128 + signum)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
print(f'child {i} ready', flush=True)
while True:
  time.sleep(0.1)
'''


def _launcher(tmp_path):
  cmd = [sys.executable, '-m', 'launch.local', '--num_processes', '2', '--devices_per_process',
         '1', '--', sys.executable, '-c', CHILD, '--workdir', str(tmp_path / 'run')]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
  ready = set()
  for line in proc.stdout:
    if ' ready' in line:
      ready.add(line.split()[0])
      if len(ready) == 2:
        break
  return proc


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM])
def test_launch_local_forwards_stop_signals_and_waits(tmp_path, sig):
  proc = _launcher(tmp_path)
  proc.send_signal(sig)
  out = proc.communicate(timeout=60)[0]
  name = signal.Signals(sig).name
  for i in (0, 1):
    assert f'[p{i}] child {i} got {name}' in out, out
  assert proc.returncode == 128 + sig, out
  assert 'Traceback' not in out, out


def test_launch_local_passes_on_a_stop_that_comes_while_the_processes_start(tmp_path,
                                                                          monkeypatch):
  """The launcher's handlers are in place before its first process starts: a SIGTERM that
  comes as it starts (before the launcher knows the process) reaches it, no other starts,
  and the launcher returns 128 + 15 rather than dying alone."""
  from launch import local  # pylint: disable=g-import-not-at-top
  made = []

  class StoppedAsItStarts(local.Process):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)
      os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler runs before it is in procs

  monkeypatch.setattr(local, 'Process', StoppedAsItStarts)
  before = signal.getsignal(signal.SIGTERM)
  code = local.launch(2, 1, [sys.executable, '-c', CHILD], str(tmp_path))
  assert code == 128 + signal.SIGTERM
  assert len(made) == 1 and made[0].popen.returncode is not None
  assert signal.getsignal(signal.SIGTERM) == before  # pylint: disable=comparison-with-callable


def _children(pid):
  with open(f'/proc/{pid}/task/{pid}/children') as f:
    return [int(p) for p in f.read().split()]


def _alive(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(') ')[1][0] != 'Z'
  except FileNotFoundError:
    return False


def test_launch_local_children_die_with_it(tmp_path):
  proc = _launcher(tmp_path)
  children = _children(proc.pid)
  assert len(children) == 2
  proc.kill()
  proc.wait()
  for pid in children:  # each gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and exits
    deadline = 600
    while _alive(pid) and deadline:
      deadline -= 1
      threading.Event().wait(0.1)
    assert not _alive(pid), f'child {pid} outlived its launcher'


# ------------------------------------------------------------- tokenizers

def test_init_from_another_tokenizer_is_refused_before_loading(tmp_path, capsys):
  """A byte-level checkpoint and a 264-token BPE: the same shapes, other meanings."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  text = ''.join(f'def f{i}(x):\n    return x * {i}\n\n' for i in range(2000))
  (tmp_path / 'corpus.txt').write_text(text)
  bpe = tokenizers.Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.train([str(tmp_path / 'corpus.txt')], trainers.BpeTrainer(
      vocab_size=264, special_tokens=['<|endoftext|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  bpe.save(str(tmp_path / 'tokenizer.json'))
  assert bpe.get_vocab_size() == 264  # what model.vocab_size holds: no shape differs
  assert _main(tmp_path / 'src', '--config.steps=1') == 0
  capsys.readouterr()
  data = [f'--config.data.path={tmp_path / "corpus.txt"}',
          f'--config.data.tokenizer={tmp_path / "tokenizer.json"}']
  assert _main(tmp_path / 'ft', '--config.steps=1', f'--config.init_from={tmp_path / "src"}',
               *data) == 2
  err = capsys.readouterr().err.strip()
  assert '\n' not in err and (
      f"init_from={tmp_path / 'src'} was trained on the ids of tokenizer '' (byte-level), "
      'this run uses tokenizer.json (sha256 ') in err, err
  assert not (tmp_path / 'ft').exists()
