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

SIGINT (Ctrl-C) and SIGTERM to the launcher are forwarded to every process,
which saves and stops (trainer/runtime.py); the launcher waits for them and
exits with their status. A second Ctrl-C is forwarded too: the processes stop at
once. The processes die with the launcher however it ends (on Linux the kernel
sends them SIGTERM when it exits, PR_SET_PDEATHSIG), so none trains on unsupervised.

A command with ``--config`` has its config loaded with the command's
``--config.*`` overrides (``--config.k=v`` or ``--config.k v``, as the trainer
reads them) and validated before anything starts or is written: bad input
exits 2 with one line ``error: ...``, as the trainer would.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import shutil
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
  for name in ('num_processes', 'devices_per_process'):
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.exit(2, f'error: --{name}={value} must be at least 1\n')
  return args, command


def trainer_args(command: list[str]) -> tuple[str | None, str | None, list[str]]:
  """The command's ``--config``, ``--workdir`` and ``--config.*`` overrides, read as
  trainer.train reads them: ``--name VALUE`` or ``--name=VALUE``, and an override
  without ``=`` takes the next argument as its value (trainer/config.py
  parse_overrides)."""
  found, overrides, i = {}, [], 0
  while i < len(command):
    arg = command[i]
    name, eq, value = arg.partition('=')
    if name in ('--config', '--workdir'):  # the last one counts, as argparse reads them
      if eq:
        found[name] = value
      elif i + 1 < len(command):
        found[name], i = command[i + 1], i + 1
    elif arg.startswith('--config.'):
      overrides.append(arg)
      if not eq and i + 1 < len(command):  # '--config.steps 10'
        overrides.append(command[i + 1])
        i += 1
    i += 1
  return found.get('--config'), found.get('--workdir'), overrides


def load_config(command: list[str]):
  """The command's config with its overrides, validated as trainer.train validates it
  before starting (no devices); None without ``--config``. Raises ValueError."""
  spec, _, overrides = trainer_args(command)
  if spec is None:
    return None
  sys.path.insert(0, os.getcwd())
  try:
    cfg = config_lib.load(spec, overrides)
    cfg.validate()
  except KeyError as e:  # as trainer.train reports them: one line
    raise ValueError(str(e).strip('"')) from None
  return cfg


def config_devices(cfg) -> int:
  """Devices a config asks for: the product of its mesh sizes."""
  sizes = list(cfg.mesh.sizes().values())
  if -1 in sizes:
    return cfg.hardware.cpu_devices
  return math.prod(sizes)


def workdir_of(command: list[str]) -> str:
  """Where the trainer writes (its --workdir, else runs/<config name>)."""
  spec, workdir, _ = trainer_args(command)
  if workdir:
    return workdir
  spec = spec or 'run'
  return os.path.join('runs', os.path.splitext(os.path.basename(spec.partition(':')[0]))[0])


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent: int):
  """A preexec_fn: the child gets SIGTERM when ``parent`` exits (Linux; elsewhere nothing)."""
  def preexec():
    if sys.platform.startswith('linux'):
      ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above: nobody would tell us
      os._exit(1)  # pylint: disable=protected-access
  return preexec


class Process:
  """One child: its output is prefixed on our stdout and copied to its log file.

  start() reads its output; the processes are all made before any reader
  thread starts (a preexec_fn is safe only in a process without threads).
  """

  def __init__(self, index: int, command: list[str], env: dict, log_path: str):
    self.index, self.log_path = index, log_path
    self.log = open(log_path, 'w', encoding='utf-8')  # pylint: disable=consider-using-with
    self.popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  start_new_session=True, preexec_fn=_die_with(os.getpid()))
    self.reader = threading.Thread(target=self._pump, daemon=True)

  def start(self) -> None:
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
  """Starts the processes and supervises them (``log_dir`` made); returns the exit status."""
  coordinator = f'127.0.0.1:{free_port()}'
  print(f'launch.local: {num} processes x {per_process} CPU devices, coordinator '
        f'{coordinator}, logs in {log_dir}/', flush=True)
  procs, stopping = [], []

  def forward(signum, frame):  # pylint: disable=unused-argument
    if not stopping:
      print(f'launch.local: {signal.Signals(signum).name}: passed on to the processes; '
            'waiting for them to save and stop', file=sys.stderr, flush=True)
    stopping.append(signum)
    for p in procs:
      p.signal(signum)

  # Passed on from before the first process starts: a stop that came while they started (or
  # once one had printed) would otherwise end the launcher alone.
  previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    for i in range(num):
      if stopping:  # none started after a stop
        break
      # CPU processes (JAX_PLATFORMS=cpu unless set): hardware.name=auto would
      # otherwise give every process all of this machine's GPUs.
      env = {'JAX_PLATFORMS': 'cpu', **os.environ, 'RINGTRAIN_COORDINATOR': coordinator,
             'RINGTRAIN_NUM_PROCESSES': str(num), 'RINGTRAIN_PROCESS_ID': str(i),
             'RINGTRAIN_CPU_DEVICES': str(per_process), 'PYTHONUNBUFFERED': '1'}
      procs.append(Process(i, command, env, os.path.join(log_dir, f'process_{i}.log')))
      if stopping:  # a stop while it started: forward may have run before it was in procs
        procs[-1].signal(stopping[0])
    for p in procs:
      p.start()
    return _supervise(procs, stopping) if procs else 128 + stopping[0]
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _supervise(procs: list[Process], stopping: list) -> int:
  """Until every process has ended; returns the launcher's exit status.

  ``stopping``: the signals passed on so far; once there is one, every process
  is waited for, however the first ended (each is saving).
  """
  while True:
    codes = [p.popen.poll() for p in procs]
    failed = [p for p, c in zip(procs, codes) if c not in (None, 0)]
    if stopping and all(c is not None for c in codes):
      for p in procs:
        p.reader.join(timeout=5)
      code = next((c for c in codes if c), 0)
      return code if code >= 0 else 128 - code
    if failed and not stopping:
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
  workdir = workdir_of(command)
  try:  # before anything is started or written
    if '://' in workdir:
      raise ValueError(f'--workdir {workdir}: launch.local keeps the logs in WORKDIR/logs, '
                       'which needs a local path')
    if shutil.which(command[0]) is None:  # else every process would fail to start
      raise ValueError(f'{command[0]}: no such program (not on PATH, or not executable)')
    cfg = load_config(command)
    if cfg is None and args.devices_per_process is None:
      raise ValueError('the command has no --config, so pass --devices_per_process')
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  per_process = args.devices_per_process
  if per_process is None:
    total = config_devices(cfg)
    if total % args.num_processes:
      print(f'error: the config asks for {total} devices, not divisible by '
            f'--num_processes={args.num_processes}; pass --devices_per_process',
            file=sys.stderr)
      return 2
    per_process = total // args.num_processes
  log_dir = os.path.join(workdir, 'logs')
  try:
    os.makedirs(log_dir, exist_ok=True)
  except OSError as e:  # the workdir is a file, or not ours to write
    print(f'error: cannot make {log_dir}: {e.strerror}', file=sys.stderr)
    return 2
  return launch(args.num_processes, per_process, command, log_dir)


if __name__ == '__main__':
  sys.exit(main())
