"""launch/tpu_pod.py against a stand-in gcloud: where the archive goes, what --stop signals."""

import os
import subprocess
import sys
import tempfile
import time

import pytest

from launch import tpu_pod

# Logs its arguments; `scp` keeps a copy of what it was given (and the mode of its
# directory); `ssh` runs the
# remote command here only when RUN_SSH is set, with a pkill that sees only the
# test's own session (never anyone else's processes on this machine).
GCLOUD = r'''#!/bin/bash
echo "$*" >> "$STANDIN/log"
if [ "$4" = scp ]; then cp "$5" "$STANDIN/sent.tgz"; stat -c %a "$(dirname "$5")" > "$STANDIN/mode"; fi
if [ "$4" = ssh ] && [ -n "$RUN_SSH" ]; then
  for a in "$@"; do case "$a" in --command=*) cmd="${a#--command=}";; esac; done
  PATH="$STANDIN/shim:$PATH" bash -c "$cmd"
fi
'''
PKILL = '#!/bin/bash\nexec /usr/bin/pkill -s "$TEST_SESSION" "$@"\n'
CURL = '#!/bin/bash\necho 0\n'  # the metadata server's worker number, without a network


def _standin(tmp_path, monkeypatch):
  standin = tmp_path / 'standin'
  (standin / 'shim').mkdir(parents=True)
  for path, text in ((standin / 'gcloud', GCLOUD), (standin / 'shim' / 'pkill', PKILL),
                     (standin / 'shim' / 'curl', CURL)):
    path.write_text(text)
    path.chmod(0o755)
  monkeypatch.setenv('PATH', f'{standin}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('STANDIN', str(standin))
  return standin


def test_archive_goes_to_a_private_directory_of_its_own(tmp_path, monkeypatch):
  standin = _standin(tmp_path, monkeypatch)
  shared_tmp = tmp_path / 'tmp'
  shared_tmp.mkdir()
  victim = tmp_path / 'victim'
  victim.write_text('precious')
  (shared_tmp / 'ringtrain.tgz').symlink_to(victim)  # planted by another user
  monkeypatch.setattr(tempfile, 'tempdir', str(shared_tmp))
  tree = tmp_path / 'tree'
  tree.mkdir()
  (tree / 'hello.py').write_text('print(1)\n')
  monkeypatch.chdir(tree)
  assert tpu_pod.main(['--tpu', 't', '--zone', 'us-central2-b', '--', 'python', '-c', 'pass']) == 0
  assert victim.read_text() == 'precious'
  scp = next(l for l in (standin / 'log').read_text().splitlines() if ' scp ' in l)
  archive = scp.split()[4]
  private = os.path.dirname(archive)
  assert os.path.dirname(private) == str(shared_tmp) and archive != str(shared_tmp / 'ringtrain.tgz')
  assert (standin / 'mode').read_text().strip() == '700'  # only this user can enter it
  assert not os.path.exists(private)  # removed after the launch
  listing = subprocess.run(['tar', 'tzf', standin / 'sent.tgz'], capture_output=True, text=True,
                           check=True).stdout
  assert './hello.py' in listing.split()


def test_stop_signals_the_trainer_and_not_shells_that_mention_it(tmp_path, monkeypatch):
  _standin(tmp_path, monkeypatch)
  fake = tmp_path / 'fake' / 'trainer'
  fake.mkdir(parents=True)
  (fake / '__init__.py').write_text('')
  (fake / 'train.py').write_text(
      'import pathlib, time\npathlib.Path("started").touch()\ntime.sleep(120)\n')
  # A shell whose command line holds 'trainer.train' (as the launch's remote
  # `bash -c ...` does), running a real `python -m trainer.train` underneath.
  shell = subprocess.Popen(
      ['bash', '-c', f'{sys.executable} -m trainer.train & wait $!; echo "shell survived $?"'],
      cwd=tmp_path / 'fake', start_new_session=True, stdout=subprocess.PIPE, text=True,
      env={k: v for k, v in os.environ.items() if k != 'PYTHONPATH'})
  try:
    deadline = time.time() + 60
    while not (tmp_path / 'fake' / 'started').exists() and time.time() < deadline:
      time.sleep(0.05)
    assert (tmp_path / 'fake' / 'started').exists(), 'the stand-in trainer never started'
    monkeypatch.setenv('TEST_SESSION', str(shell.pid))
    monkeypatch.setenv('RUN_SSH', '1')
    assert tpu_pod.main(['--tpu', 't', '--zone', 'us-central2-b', '--stop']) == 0
    out = shell.communicate(timeout=30)[0]
  finally:
    if shell.poll() is None:
      os.killpg(shell.pid, 9)
  # The trainer alone got SIGTERM (128 + 15); the shell around it went on.
  assert shell.returncode == 0 and 'shell survived 143' in out


def test_the_venv_is_made_by_the_python_asked_for():
  """Ubuntu 22.04 TPU images have Python 3.10; setup.py asks for 3.11 or later."""
  args = tpu_pod.parse_args(['--tpu', 't', '--zone', 'us-central2-b', '--python', 'python3.11',
                             '--', 'python', '-m', 'trainer.train'])
  setup = [a for c in tpu_pod.commands(args, '/private/ringtrain.tgz') for a in c
           if a.startswith('--command=') and '-m venv' in a]
  assert len(setup) == 1 and 'python3.11 -m venv .venv' in setup[0]


def _run_on_the_worker(script):
  """tpu_pod --skip_setup running ``sh -c script`` through the stand-in's ssh."""
  return tpu_pod.main(['--tpu', 't', '--zone', 'us-central2-b', '--skip_setup', '--', 'sh', '-c',
                       script])


def test_a_command_failing_on_a_worker_fails_the_launch(tmp_path, monkeypatch, capfd):
  """Its status passes through the pipe to tee and sed (not sed's 0), and one line says so."""
  _standin(tmp_path, monkeypatch)
  (tmp_path / 'home' / tpu_pod.REMOTE_DIR).mkdir(parents=True)
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  monkeypatch.setenv('RUN_SSH', '1')
  assert _run_on_the_worker('echo training; exit 3') == 3
  out, err = capfd.readouterr()
  assert '[w0] training' in out
  assert len(err.splitlines()) == 1 and err.startswith('error: gcloud compute tpus tpu-vm ssh '
                                                       'exited with status 3'), err
  log = tmp_path / 'home' / tpu_pod.REMOTE_DIR / 'logs' / 'worker_0.log'
  assert log.read_text() == 'training\n'
  assert _run_on_the_worker('exit 143') == 143  # the trainer's status after a SIGTERM
  err = capfd.readouterr().err
  assert len(err.splitlines()) == 1 and 'stopped by SIGTERM (preempted, or --stop)' in err, err
  assert _run_on_the_worker('echo done') == 0
  assert capfd.readouterr().err == ''


def test_without_gcloud_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv('PATH', str(tmp_path))  # no gcloud there
  monkeypatch.chdir(tmp_path)
  assert tpu_pod.main(['--tpu', 't', '--zone', 'us-central2-b', '--', 'python', '-c', 'pass']) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and err.startswith('error: gcloud not found'), err
  assert os.listdir(tmp_path) == []  # nothing packed
  assert tpu_pod.main(['--tpu', 't', '--zone', 'us-central2-b', '--stop']) == 2
  assert capsys.readouterr().err.startswith('error: gcloud not found')


@pytest.mark.parametrize('flag,value,expected', [
    ('--tpu', 'my v4', "--tpu 'my v4' is not a TPU VM name"),
    ('--tpu', 'My-v4', "--tpu 'My-v4' is not a TPU VM name"),
    ('--tpu', 'v4-', "--tpu 'v4-' is not a TPU VM name"),
    ('--zone', 'us central2-b', "--zone 'us central2-b' is not a zone name like us-central2-b"),
    ('--zone', 'us-central2', "--zone 'us-central2' is not a zone name"),
])
def test_a_bad_tpu_or_zone_name_is_refused_before_anything_runs(flag, value, expected, capsys,
                                                                  monkeypatch):
  monkeypatch.setattr(tpu_pod.subprocess, 'call', lambda *a: pytest.fail('ran'))
  names = {'--tpu': 'my-v4', '--zone': 'us-central2-b', flag: value}
  with pytest.raises(SystemExit) as stop:
    tpu_pod.main([a for kv in names.items() for a in kv] + ['--', 'python', '-c', 'pass'])
  assert stop.value.code == 2 and expected in capsys.readouterr().err.splitlines()[-1]
  for zone in ('europe-west4-a', 'northamerica-northeast1-a', 'us-east5-b'):  # real ones pass
    assert tpu_pod.parse_args(['--tpu', 'my-v4', '--zone', zone, '--stop']).zone == zone
