r"""Runs a command on every worker of a Cloud TPU VM slice, through gcloud.

  python -m launch.tpu_pod --tpu NAME --zone ZONE [--project P] [--dry_run] \
      [--python python3.11] [--skip_setup] -- python -m trainer.train --config ...
  python -m launch.tpu_pod --tpu NAME --zone ZONE [--project P] --stop

1. packs this working tree (without .venv, runs, .cache, .git), in a private
   temporary directory of this launch, and copies it to every worker
   (``gcloud compute tpus tpu-vm scp ... --worker=all``);
2. installs it there in ``~/ringtrain/.venv`` (made by ``--python``, Python 3.11
   or later) with the ``tpu`` extra, at the versions of constraints.txt;
3. runs the command on all workers at once (``gcloud compute tpus tpu-vm ssh
   ... --worker=all``), ``python`` meaning that venv's, with
   ``--config.distributed.auto=True`` added to trainer commands (the workers
   find each other; trainer/runtime.py). Every output line is prefixed with
   ``[w<worker number>]`` and also kept in ``~/ringtrain/logs/`` on its worker.
   A command that fails on a worker fails the launch: its status passes through
   the output's pipe (``set -o pipefail``) and gcloud, and the launch says so in
   one line and exits non-zero.

``--stop`` sends SIGTERM to the trainer on every worker (the processes running
``python -m trainer.train``, not shells whose command line mentions it): each
saves a checkpoint after its current step and exits; run the same launch
command to resume.
``--dry_run`` prints the exact commands instead of running them.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

REMOTE_DIR = 'ringtrain'
ARCHIVE = 'ringtrain.tgz'  # in a fresh private directory per launch: see main()
# What --stop signals: a Python interpreter running the trainer module. An
# extended regex over the whole command line, anchored at the program, so that
# the shells whose command lines merely contain 'trainer.train' (ours, the
# launch's `bash -c ...`) are left alone.
TRAINER_PATTERN = '^[^ ]*python[0-9.]* (-[^ ]+ )*-m trainer[.]train( |$)'
# Cloud TPU VM names (lowercase letters, digits and hyphens, a letter first, 63 at most)
# and zone names (us-central2-b, europe-west4-a).
TPU_NAME = r'[a-z]([-a-z0-9]{0,61}[a-z0-9])?'
ZONE_NAME = r'[a-z]+(-[a-z]+)*[0-9]+-[a-z]'
EXCLUDES = ('.venv', 'runs', '.cache', '.git', '__pycache__')
WORKER_NUMBER = ('$(curl -s -H "Metadata-Flavor: Google" http://metadata.google.internal/'
                 'computeMetadata/v1/instance/attributes/agent-worker-number)')


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m launch.tpu_pod', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--tpu', required=True, help='TPU VM name')
  parser.add_argument('--zone', required=True)
  parser.add_argument('--project', default=None)
  parser.add_argument('--dry_run', action='store_true', help='print the commands only')
  parser.add_argument('--python', default='python3',
                      help="the workers' Python for the venv: 3.11 or later (setup.py); "
                           'Ubuntu 22.04 images: python3.11 (apt-get install python3.11-venv)')
  parser.add_argument('--skip_setup', action='store_true',
                      help='do not copy and install the tree (already there)')
  parser.add_argument('--stop', action='store_true', help='stop the trainer on all workers')
  parser.add_argument('command', nargs=argparse.REMAINDER, help='-- COMMAND ...')
  args = parser.parse_args(argv)
  args.command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not args.stop and not args.command:
    parser.error('no command given after -- (or pass --stop)')
  for flag, value, form, what in (
      ('--tpu', args.tpu, TPU_NAME, 'a TPU VM name (lowercase letters, digits and hyphens, '
                                    'a letter first, 63 at most)'),
      ('--zone', args.zone, ZONE_NAME, 'a zone name like us-central2-b')):
    if not re.fullmatch(form, value):  # caught here, not by gcloud after the tree is packed
      parser.error(f'{flag} {value!r} is not {what}')
  return args


def _gcloud(args, verb: str, *rest: str) -> list[str]:
  cmd = ['gcloud', 'compute', 'tpus', 'tpu-vm', verb, *rest, f'--zone={args.zone}',
         '--worker=all']
  return cmd + ([f'--project={args.project}'] if args.project else [])


def _ssh(args, remote: str) -> list[str]:
  return _gcloud(args, 'ssh', args.tpu, f'--command={remote}')


def remote_command(command: list[str]) -> str:
  """The shell line each worker runs: the venv's python, auto distributed, prefixed output."""
  command = list(command)
  if command and command[0] in ('python', 'python3'):
    command[0] = '.venv/bin/python'
  if 'trainer.train' in command and not any('distributed.auto' in a for a in command):
    command.append('--config.distributed.auto=True')
  # pipefail: the line's status is the command's, not sed's (the workers' shell is bash).
  return (f'set -o pipefail && cd ~/{REMOTE_DIR} && mkdir -p logs && W={WORKER_NUMBER} && '
          f'{shlex.join(command)} 2>&1 | tee logs/worker_$W.log | sed -u "s/^/[w$W] /"')


def commands(args, archive: str) -> list[list[str]]:
  """Everything to run, in order; ``archive``: where to pack the tree (a private path)."""
  if args.stop:
    return [_ssh(args, f'pkill -TERM -f {shlex.quote(TRAINER_PATTERN)} || true')]
  steps = []
  if not args.skip_setup:
    excludes = [f'--exclude=./{e}' for e in EXCLUDES]
    steps += [
        ['tar', 'czf', archive, *excludes, '.'],
        _gcloud(args, 'scp', archive, f'{args.tpu}:~/'),
        _ssh(args, f'mkdir -p ~/{REMOTE_DIR} && tar xzf ~/{ARCHIVE} -C ~/{REMOTE_DIR} && '
                   f'cd ~/{REMOTE_DIR} && {shlex.quote(args.python)} -m venv .venv && '
                   ".venv/bin/pip install -q -c constraints.txt -e '.[tpu]'"),
    ]
  return steps + [_ssh(args, remote_command(args.command))]


def main(argv=None) -> int:
  args = parse_args(argv)
  needed = ['gcloud'] + ([] if args.stop or args.skip_setup else ['tar'])
  missing = [p for p in needed if not args.dry_run and shutil.which(p) is None]
  if missing:
    print(f'error: {missing[0]} not found on PATH' + (
        ' (install the Google Cloud CLI: https://cloud.google.com/sdk/docs/install)'
        if missing[0] == 'gcloud' else ''), file=sys.stderr)
    return 2
  # mkdtemp: a new directory only this user can enter, so no one else can plant a
  # symlink where the archive goes or swap the archive before it is copied.
  with tempfile.TemporaryDirectory(prefix='ringtrain-launch-') as private:
    steps = commands(args, os.path.join(private, ARCHIVE))
    for cmd in steps:
      print(shlex.join(cmd), flush=True)
      if args.dry_run:
        continue
      try:
        status = subprocess.call(cmd)
      except FileNotFoundError:  # gone since the check above
        print(f'error: {cmd[0]} not found on PATH', file=sys.stderr)
        return 2
      if status:
        what = ' '.join(cmd[:5]) if cmd[0] == 'gcloud' else cmd[0]
        why = ('' if args.stop else
               ': the command was not run' if cmd is not steps[-1] else
               ': stopped by SIGTERM (preempted, or --stop) after saving; launch the same '
               'command again to continue' if status == 143 else
               ': the command failed on a worker (its [w<n>] lines above, its log in '
               f'~/{REMOTE_DIR}/logs/ there), or gcloud could not run it')
        print(f'error: {what} exited with status {status}{why}', file=sys.stderr)
        return status if status > 0 else 128 - status  # killed by a signal: 128 + its number
  return 0


if __name__ == '__main__':
  sys.exit(main())
