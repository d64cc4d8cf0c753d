"""Process-level runtime set-up, done once by each entry point before JAX starts.

``start(cfg)`` does all of it for a training config (trainer.train,
trainer.evaluate); the parts below serve other entry points and tests.

* The number of simulated CPU devices comes from ``RINGTRAIN_CPU_DEVICES`` when
  set (a launcher gives each process its share), else from the config.
* XLA's CPU collective timeouts are raised: with many fake devices on few cores
  a collective can wait for its peer threads longer than the 40 s default, and
  XLA then aborts the whole process.
* The platform (``probe_platform``) is decided before JAX starts, and with it
  the compiler flags of the chip: ``LIBTPU_INIT_ARGS`` on a TPU, ``XLA_FLAGS`` on
  a GPU (both are read once, when JAX opens the device). This is the one place
  that sets them for training.
* A persistent compilation cache makes repeated runs and tests start faster.
* Multi-process runs start JAX's distributed runtime (``start_distributed``):
  on TPU pod workers by auto-detection, else from an explicit coordinator
  address, process count and id, which the launcher (launch/local.py) passes
  through ``RINGTRAIN_COORDINATOR``, ``RINGTRAIN_NUM_PROCESSES`` and
  ``RINGTRAIN_PROCESS_ID``. CPU processes exchange collectives over gloo.
* Stop signals (``stop_signals``): SIGTERM (a preemption), SIGINT (Ctrl-C) and
  SIGHUP (a closed terminal) make the training loop save and stop after the
  step in flight, exiting 128 + the signal's number; a second SIGINT ends the
  process at once, saving nothing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import threading

import jax
import numpy as np

from parallelism import hardware
from trainer import hints
from trainer.config import Config

CPU_DEVICES_ENV = 'RINGTRAIN_CPU_DEVICES'
COORDINATOR_ENV = 'RINGTRAIN_COORDINATOR'
NUM_PROCESSES_ENV = 'RINGTRAIN_NUM_PROCESSES'
PROCESS_ID_ENV = 'RINGTRAIN_PROCESS_ID'
XLA_CPU_FLAGS = (
    '--xla_cpu_collective_call_terminate_timeout_seconds=600',
    '--xla_cpu_collective_call_warn_stuck_timeout_seconds=120',
    '--xla_cpu_collective_timeout_seconds=600',
)


def cpu_device_count(default: int) -> int:
  """Devices to simulate on CPU: the environment variable wins over the config."""
  raw = os.environ.get(CPU_DEVICES_ENV)
  if raw is None:
    return default
  if not raw.isdigit() or int(raw) < 1:
    raise ValueError(f'{CPU_DEVICES_ENV}={raw!r} is not a positive integer')
  return int(raw)


# What JAX_PLATFORMS names -> the platform of parallelism/hardware.py's rows.
JAX_PLATFORM_NAMES = {'cpu': 'cpu', 'tpu': 'tpu', 'cuda': 'gpu', 'gpu': 'gpu'}
GOOGLE_PCI_VENDOR = '0x1ae0'  # TPU chips on the PCI bus (what JAX itself looks for)
PCI_VENDOR_FILES = '/sys/bus/pci/devices/*/vendor'
NVIDIA_DEVICE_FILES = ('/dev/nvidia0', '/dev/nvidiactl')


def probe_platform() -> str:
  """'tpu', 'gpu' or 'cpu': where this process will run, decided without starting JAX.

  ``JAX_PLATFORMS`` wins when set; else a TPU chip on the PCI bus, then an
  NVIDIA device file, else the CPU. Not ``jax.devices()``: with the ``tpu``
  extra installed, JAX on a machine without a TPU first tries to open one
  (warnings and a slow start), and the chip's compiler flags must be in the
  environment before JAX opens the device. The chip itself is detected from
  ``jax.devices()`` afterwards (parallelism/hardware.py ``detect``).
  """
  requested = os.environ.get('JAX_PLATFORMS', '').split(',')[0].strip().lower()
  if requested:
    if requested not in JAX_PLATFORM_NAMES:
      raise ValueError(f'JAX_PLATFORMS={os.environ["JAX_PLATFORMS"]!r}: ringtrain runs on '
                       f'{", ".join(JAX_PLATFORM_NAMES)}')
    return JAX_PLATFORM_NAMES[requested]
  for path in glob.glob(PCI_VENDOR_FILES):
    with open(path, encoding='ascii') as f:
      if f.read().strip() == GOOGLE_PCI_VENDOR:
        return 'tpu'
  return 'gpu' if any(os.path.exists(p) for p in NVIDIA_DEVICE_FILES) else 'cpu'


def add_xla_flags(flags=XLA_CPU_FLAGS) -> None:
  """Appends flags to XLA_FLAGS unless the user already set them."""
  current = os.environ.get('XLA_FLAGS', '')
  extra = [f for f in flags if f.split('=')[0] not in current]
  os.environ['XLA_FLAGS'] = ' '.join([current] + extra).strip()


def configure_host(cpu_devices: int, cache_dir: str | None = None,
                   platform: str | None = None, compiler_flags: str = '') -> None:
  """Must run before the first JAX computation of the process.

  ``platform`` (``probe_platform``'s answer, or None: JAX decides) opens only
  that platform: with the ``tpu`` extra installed, JAX otherwise first tries to
  open a TPU on a CPU machine, and a TPU or GPU whose plugin is missing fails
  loudly instead of falling back to the CPU. An explicit JAX_PLATFORMS stays.
  ``compiler_flags`` (the chip's, ``hardware.xla_flags``) go to
  ``LIBTPU_INIT_ARGS`` on a TPU, before the user's own, so the user's win; to
  ``XLA_FLAGS`` on a GPU, unless the user's XLA_FLAGS set the same flag.
  """
  if platform:
    # The CPU beside an accelerator too: host-side arrays (checkpoints) may use it.
    os.environ.setdefault('JAX_PLATFORMS', {'cpu': 'cpu', 'tpu': 'tpu,cpu', 'gpu': 'cuda,cpu'}[platform])
  if platform == 'tpu' and compiler_flags:
    os.environ['LIBTPU_INIT_ARGS'] = ' '.join(
        filter(None, [compiler_flags, os.environ.get('LIBTPU_INIT_ARGS', '')]))
  if platform == 'gpu':
    add_xla_flags(compiler_flags.split())
  add_xla_flags()
  # JAX reads JAX_PLATFORMS when first imported, which may have been before this.
  platforms = os.environ.get('JAX_PLATFORMS') or None
  if jax.config.jax_platforms != platforms:  # settable only before JAX starts
    jax.config.update('jax_platforms', platforms)
  if jax.config.jax_num_cpu_devices != cpu_devices:  # settable only before JAX starts
    jax.config.update('jax_num_cpu_devices', cpu_devices)
  cache_dir = cache_dir or os.environ.get('RINGTRAIN_COMPILATION_CACHE')
  # Only process 0 writes the cache. jax_share_binary_between_hosts (process 0 compiles
  # and sends the executable) stays off: the others wait under their own cache key, which
  # on the CPU differs per process (its topology is hashed), so they waited out the 20 min
  # timeout here (JAX 0.10.2); and where process 0 hits a per-host cache the others miss,
  # they wait for an executable that is never sent.
  if cache_dir:
    jax.config.update('jax_compilation_cache_dir', cache_dir)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def distributed_settings(dist_cfg) -> dict | None:
  """The ``distributed.*`` config with the launcher's environment applied; None: one process.

  Raises ValueError for inconsistent settings.
  """
  coordinator = os.environ.get(COORDINATOR_ENV, dist_cfg.coordinator_address)
  num = os.environ.get(NUM_PROCESSES_ENV, str(dist_cfg.num_processes))
  pid = os.environ.get(PROCESS_ID_ENV, str(dist_cfg.process_id))
  for name, raw in (('num_processes', num), ('process_id', pid)):
    if not raw.lstrip('-').isdigit():
      raise ValueError(f'distributed.{name}={raw!r} is not an integer')
  num, pid = int(num), int(pid)
  if dist_cfg.auto:
    return {'auto': True, 'timeouts': _timeouts(dist_cfg)}
  if num == 1 and not coordinator:
    return None
  if not coordinator or num < 1 or not 0 <= pid < num:
    raise ValueError(f'distributed: coordinator_address={coordinator!r}, num_processes={num}, '
                     f'process_id={pid}: need an address host:port, num_processes >= 1 and '
                     '0 <= process_id < num_processes')
  host, _, port = coordinator.rpartition(':')
  if not host or not port.isdigit():
    raise ValueError(f'distributed.coordinator_address={coordinator!r} is not host:port')
  bind = dist_cfg.bind_address or (coordinator if _is_loopback(host) else '')
  return {'auto': False, 'coordinator_address': coordinator, 'num_processes': num,
          'process_id': pid, 'bind_address': bind, 'timeouts': _timeouts(dist_cfg)}


def _timeouts(dist_cfg) -> dict:
  return {'initialization_timeout': dist_cfg.initialization_timeout,
          'heartbeat_timeout_seconds': dist_cfg.heartbeat_timeout,
          'shutdown_timeout_seconds': dist_cfg.shutdown_timeout}


def _is_loopback(host: str) -> bool:
  return host in ('localhost', '::1', '[::1]') or host.startswith('127.')


def start_distributed(settings: dict | None, cpu: bool) -> None:
  """Starts JAX's distributed runtime for ``distributed_settings``' result (before JAX runs).

  The coordinator (process 0) listens on ``bind_address`` when given (the
  loopback address for local runs), else on all interfaces, JAX's default.
  """
  if settings is None:
    return
  if cpu:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if settings['auto']:  # TPU pod workers find each other themselves
    jax.distributed.initialize(**settings['timeouts'])
    return
  jax.distributed.initialize(
      settings['coordinator_address'], settings['num_processes'], settings['process_id'],
      coordinator_bind_address=settings['bind_address'] or None, **settings['timeouts'])


def _platform_hint(platform: str) -> str:
  """What to do when JAX cannot open ``platform``: a command that exists."""
  if platform == 'cpu':  # jaxlib itself: the CPU needs no plugin
    return (f'reinstall JAX ({hints.PIP_INSTALL} .), and check XLA_FLAGS '
            f'and {CPU_DEVICES_ENV}')
  extra = {'tpu': 'tpu', 'gpu': 'cuda12'}[platform]
  return (f'install the {extra} extra ({hints.install_hint(extra)}), or '
          'set JAX_PLATFORMS=cpu to train on the CPU')


def start(cfg: Config) -> hardware.HardwareProfile:
  """Starts JAX on this machine's platform with the chip's compiler flags.

  Returns the profile of ``hardware.name``: the detected chip's for 'auto',
  else the named one after checking that it matches the devices. 'cpu' keeps
  to the CPU (simulated devices) whatever else the machine has. Raises
  ValueError for a platform JAX cannot open or a chip that is not the devices.
  """
  name = cfg.hardware.name
  platform = 'cpu' if name == 'cpu' else probe_platform()
  configure_host(cpu_device_count(cfg.hardware.cpu_devices), platform=platform,
                 compiler_flags=hardware.startup_flags(name, platform, cfg.hardware.xla_flags))
  start_distributed(distributed_settings(cfg.distributed), cpu=platform == 'cpu')
  try:
    devices = jax.devices()
  except RuntimeError as e:  # a visible TPU or GPU whose JAX plugin is missing or broken
    raise ValueError(f'JAX cannot open the {platform} ({str(e).splitlines()[0]}); '
                     + _platform_hint(platform)) from None
  return hardware.detect(name, [d.device_kind for d in devices])


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
  """What the loop asks at each step boundary: stop (a signal's number) or go on (0)."""

  def __init__(self):
    self.received = 0        # the first stop signal's number
    self.save_failure = None  # a failed save this process learned of, until all know

  def handle(self, signum, frame) -> None:  # pylint: disable=unused-argument
    if not self.received:
      self.received = signum
      print(f'{signal.Signals(signum).name}: saving and stopping after this step'
            + ('; Ctrl-C again stops at once, saving nothing' if signum == signal.SIGINT
               else ''), file=sys.stderr, flush=True)
    if signum == signal.SIGINT:  # the second one: the kernel's default, at once
      signal.signal(signal.SIGINT, signal.SIG_DFL)

  def check(self, ckpt, agree: bool = True) -> int:
    """The signal to stop for (0: none); raises checkpoint.SaveFailed after a failed save.

    With several processes, signals (and a save's failure) reach them at different
    moments; they agree (an all-gather, which waits for the step in flight) where
    the loop passes ``agree=True``, so that all save and stop after the same step;
    elsewhere they answer 0. A single process answers for itself.
    """
    from trainer import checkpoint  # pylint: disable=g-import-not-at-top
    try:
      ckpt.check()
    except checkpoint.SaveFailed as e:
      self.save_failure = e
    if jax.process_count() == 1:
      if self.save_failure:
        raise self.save_failure
      return self.received
    if not agree:
      return 0
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    flags = multihost_utils.process_allgather(
        np.array([self.received, self.save_failure is not None], np.int32))
    flags = np.asarray(flags).reshape(-1, 2)
    if self.save_failure:
      raise self.save_failure
    if flags[:, 1].any():
      raise checkpoint.SaveFailed('a checkpoint save failed on another process (its log '
                                  'names the path and the error); stopped')
    return int(flags[:, 0].max())


@contextlib.contextmanager
def stop_signals():
  """Handles STOP_SIGNALS while the loop runs; yields the StopSignals it asks.

  Off the main thread (signals reach only it) nothing is handled.
  """
  stops = StopSignals()
  if threading.current_thread() is not threading.main_thread():
    yield stops
    return
  previous = {sig: signal.signal(sig, stops.handle) for sig in STOP_SIGNALS}
  try:
    yield stops
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
