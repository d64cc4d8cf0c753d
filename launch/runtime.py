"""Process-level runtime set-up, done once by each entry point before JAX starts.

* The number of simulated CPU devices comes from ``RINGTRAIN_CPU_DEVICES`` when
  set (a launcher gives each process its share), else from the config.
* XLA's CPU collective timeouts are raised: with many fake devices on few cores
  a collective can wait for its peer threads longer than the 40 s default, and
  XLA then aborts the whole process.
* A persistent compilation cache makes repeated runs and tests start faster.
"""

from __future__ import annotations

import os

CPU_DEVICES_ENV = 'RINGTRAIN_CPU_DEVICES'
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
                   cpu_only: bool = False) -> None:
  """Must run before the first JAX computation of the process.

  ``cpu_only`` defaults JAX_PLATFORMS to ``cpu`` (unless set): with the ``tpu``
  extra installed, JAX otherwise first tries to open a TPU on a CPU machine.
  """
  if cpu_only:
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  add_xla_flags()
  import jax  # pylint: disable=g-import-not-at-top
  if jax.config.jax_num_cpu_devices != cpu_devices:  # settable only before JAX starts
    jax.config.update('jax_num_cpu_devices', cpu_devices)
  cache_dir = cache_dir or os.environ.get('RINGTRAIN_COMPILATION_CACHE')
  if cache_dir:
    jax.config.update('jax_compilation_cache_dir', cache_dir)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
