"""Process-level runtime set-up, done once by each entry point before JAX starts.

* The number of simulated CPU devices comes from ``RINGTRAIN_CPU_DEVICES`` when
  set (a launcher gives each process its share), else from the config.
* XLA's CPU collective timeouts are raised: with many fake devices on few cores
  a collective can wait for its peer threads longer than the 40 s default, and
  XLA then aborts the whole process.
* A persistent compilation cache makes repeated runs and tests start faster.
* Multi-process runs start JAX's distributed runtime (``start_distributed``):
  on TPU pod workers by auto-detection, else from an explicit coordinator
  address, process count and id, which the launcher (launch/local.py) passes
  through ``RINGTRAIN_COORDINATOR``, ``RINGTRAIN_NUM_PROCESSES`` and
  ``RINGTRAIN_PROCESS_ID``. CPU processes exchange collectives over gloo.
"""

from __future__ import annotations

import os

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


def add_xla_flags(flags=XLA_CPU_FLAGS) -> None:
  """Appends flags to XLA_FLAGS unless the user already set them."""
  current = os.environ.get('XLA_FLAGS', '')
  extra = [f for f in flags if f.split('=')[0] not in current]
  os.environ['XLA_FLAGS'] = ' '.join([current] + extra).strip()


def configure_host(cpu_devices: int, cache_dir: str | None = None,
                   cpu_only: bool = False, tpu_flags: str = '') -> None:
  """Must run before the first JAX computation of the process.

  ``cpu_only`` defaults JAX_PLATFORMS to ``cpu`` (unless set): with the ``tpu``
  extra installed, JAX otherwise first tries to open a TPU on a CPU machine.
  ``tpu_flags`` (the chip's default compiler flags, ``hardware.xla_flags``)
  go before the user's own ``LIBTPU_INIT_ARGS``, so the user's win.
  """
  if cpu_only:
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  if tpu_flags:
    os.environ['LIBTPU_INIT_ARGS'] = ' '.join(
        filter(None, [tpu_flags, os.environ.get('LIBTPU_INIT_ARGS', '')]))
  add_xla_flags()
  import jax  # pylint: disable=g-import-not-at-top
  if jax.config.jax_num_cpu_devices != cpu_devices:  # settable only before JAX starts
    jax.config.update('jax_num_cpu_devices', cpu_devices)
  cache_dir = cache_dir or os.environ.get('RINGTRAIN_COMPILATION_CACHE')
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
  import jax  # pylint: disable=g-import-not-at-top
  if cpu:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if settings['auto']:  # TPU pod workers find each other themselves
    jax.distributed.initialize(**settings['timeouts'])
    return
  jax.distributed.initialize(
      settings['coordinator_address'], settings['num_processes'], settings['process_id'],
      coordinator_bind_address=settings['bind_address'] or None, **settings['timeouts'])
