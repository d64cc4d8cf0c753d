r"""Runs one command as N cooperating JAX processes on this machine.

  python -m launch.local --num_processes 2 [--devices_per_process 4] -- \
      python -m trainer.train --config configs/default.py --workdir runs/mp

Each process gets a distinct process id, the coordinator address (a free port
on the loopback address: nothing listens on other interfaces) and its share of
CPU devices through the environment (``RINGTRAIN_COORDINATOR``,
``RINGTRAIN_NUM_PROCESSES``, ``RINGTRAIN_PROCESS_ID``, ``RINGTRAIN_CPU_DEVICES``;
see trainer/runtime.py). The default share is the config's device count (the
product of its mesh sizes) divided by N. Output lines are prefixed with
``[p<id>]`` and each process's output is also kept in ``WORKDIR/logs/``. When a
process fails, the others get a moment to end by themselves (an error they all
meet, each reports), then are stopped (SIGTERM, then SIGKILL after a grace
period), the tail of the failing process's log is shown, and the launcher exits
with that process's status, all within 60 seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from trainer import config as config_lib

GRACE_SECONDS = 10  # between SIGTERM and SIGKILL when stopping the others
SETTLE_SECONDS = 2  # for the others to end by themselves once one has failed
TAIL_LINES = 30


def free_port() -> int:
  """A TCP port free on the loopback address right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m launch.local', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--num_processes', type=int, required=True)
  parser.add_argument('--devices_per_process', type=int, default=None,
                      help='CPU devices per process (default: config devices / N)')
  parser.add_argument('command', nargs=argparse.REMAINDER, help='-- COMMAND ...')
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    parser.error('no command given after --')
  if args.num_processes < 1:
    parser.error(f'--num_processes={args.num_processes} must be at least 1')
  return args, command


def _option(command: list[str], name: str) -> str | None:
  """The value of ``--name VALUE`` or ``--name=VALUE`` in a command line."""
  for i, arg in enumerate(command):
    if arg == name and i + 1 < len(command):
      return command[i + 1]
    if arg.startswith(name + '='):
      return arg.split('=', 1)[1]
  return None


def config_devices(command: list[str]) -> int:
  """Devices the command's config asks for: the product of its mesh sizes."""
  sys.path.insert(0, os.getcwd())
  spec = _option(command, '--config')
  if spec is None:
    raise ValueError('the command has no --config, so pass --devices_per_process')
  overrides = [a for a in command if a.startswith('--config.')]
  cfg = config_lib.load(spec, overrides)
  sizes = list(cfg.mesh.sizes().values())
  if -1 in sizes:
    return cfg.hardware.cpu_devices
  return math.prod(sizes)


def workdir_of(command: list[str]) -> str:
  """Where the trainer writes (its --workdir, else runs/<config name>)."""
  workdir = _option(command, '--workdir')
  if workdir:
    return workdir
  spec = _option(command, '--config') or 'run'
  return os.path.join('runs', os.path.splitext(os.path.basename(spec.partition(':')[0]))[0])


class Process:
  """One child: its output is prefixed on our stdout and copied to its log file."""

  def __init__(self, index: int, command: list[str], env: dict, log_path: str):
    self.index, self.log_path = index, log_path
    self.log = open(log_path, 'w', encoding='utf-8')  # pylint: disable=consider-using-with
    self.popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  start_new_session=True)
    self.reader = threading.Thread(target=self._pump, daemon=True)
    self.reader.start()

  def _pump(self) -> None:
    for line in self.popen.stdout:
      self.log.write(line)
      self.log.flush()
      sys.stdout.write(f'[p{self.index}] {line}')
      sys.stdout.flush()

  def signal(self, sig) -> None:
    if self.popen.poll() is None:
      try:
        os.killpg(self.popen.pid, sig)  # the process and anything it started
      except ProcessLookupError:
        pass

  def tail(self) -> str:
    self.reader.join(timeout=5)
    with open(self.log_path, encoding='utf-8', errors='replace') as f:
      return ''.join(f.readlines()[-TAIL_LINES:])


def launch(num: int, per_process: int, command: list[str], log_dir: str) -> int:
  """Starts the processes and supervises them; returns the exit status."""
  os.makedirs(log_dir, exist_ok=True)
  coordinator = f'127.0.0.1:{free_port()}'
  print(f'launch.local: {num} processes x {per_process} CPU devices, coordinator '
        f'{coordinator}, logs in {log_dir}/', flush=True)
  procs = []
  for i in range(num):
    # CPU processes (JAX_PLATFORMS=cpu unless set): hardware.name=auto would
    # otherwise give every process all of this machine's GPUs.
    env = {'JAX_PLATFORMS': 'cpu', **os.environ, 'RINGTRAIN_COORDINATOR': coordinator,
           'RINGTRAIN_NUM_PROCESSES': str(num), 'RINGTRAIN_PROCESS_ID': str(i),
           'RINGTRAIN_CPU_DEVICES': str(per_process), 'PYTHONUNBUFFERED': '1'}
    procs.append(Process(i, command, env, os.path.join(log_dir, f'process_{i}.log')))
  previous = signal.signal(signal.SIGTERM, lambda *_: _stop(procs))
  try:
    return _supervise(procs)
  finally:
    signal.signal(signal.SIGTERM, previous)


def _supervise(procs: list[Process]) -> int:
  while True:
    codes = [p.popen.poll() for p in procs]
    failed = [p for p, c in zip(procs, codes) if c not in (None, 0)]
    if failed:
      first = failed[0]
      code = first.popen.returncode
      print(f'launch.local: process {first.index} exited with status {code}; stopping the '
            'others', file=sys.stderr, flush=True)
      _wait(procs, SETTLE_SECONDS)  # an error every process meets: each says it
      _stop(procs)
      for p in procs:  # forward what each process printed before it ended
        p.reader.join(timeout=5)
      print(f'--- last lines of {first.log_path} ---\n{first.tail()}', file=sys.stderr,
            flush=True)
      return code if code > 0 else 128 - code  # killed by a signal: 128 + its number
    if all(c == 0 for c in codes):
      for p in procs:
        p.reader.join(timeout=5)
      return 0
    time.sleep(0.2)


def _wait(procs: list[Process], seconds: float) -> None:
  """Until every process has ended, or ``seconds`` have passed."""
  deadline = time.time() + seconds
  while time.time() < deadline and any(p.popen.poll() is None for p in procs):
    time.sleep(0.2)


def _stop(procs: list[Process]) -> None:
  """SIGTERM to the running processes; SIGKILL to those still there after the grace."""
  for p in procs:
    p.signal(signal.SIGTERM)
  _wait(procs, GRACE_SECONDS)
  for p in procs:
    p.signal(signal.SIGKILL)
    p.popen.wait()


def main(argv=None) -> int:
  args, command = parse_args(argv)
  per_process = args.devices_per_process
  if per_process is None:
    try:
      total = config_devices(command)
    except ValueError as e:
      print(f'error: {e}', file=sys.stderr)
      return 2
    if total % args.num_processes:
      print(f'error: the config asks for {total} devices, not divisible by '
            f'--num_processes={args.num_processes}; pass --devices_per_process',
            file=sys.stderr)
      return 2
    per_process = total // args.num_processes
  return launch(args.num_processes, per_process, command,
                os.path.join(workdir_of(command), 'logs'))


if __name__ == '__main__':
  sys.exit(main())
