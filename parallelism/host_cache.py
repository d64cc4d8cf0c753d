"""Numbers measured once per machine and kept in ``~/.cache/ringtrain/``.

The CPU's matmul peak (the denominator of CPU MFU) measured at every start
moved with the load of the moment: two starts measured 147 and 293 GFLOP/s, so
identical steps showed 35% and 14% MFU. Measured once and reused, it is the
same for every start on the machine. An entry is keyed by the CPU model, the
cores this process may use and the jaxlib version (XLA's CPU kernels change
with it), and records the load average it was measured at (other processes on
the cores lower it); delete the file to measure again. ``$XDG_CACHE_HOME``
moves the cache; a cache that cannot be written costs a measurement per start.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Callable

import jaxlib


def cache_dir() -> str:
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'ringtrain')


def machine_key() -> str:
  """What a cached measurement depends on: CPU model, usable cores, jaxlib version."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return f'{_cpu_model()}, {cores} cores, jaxlib {jaxlib.__version__}'


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cached(name: str, measure: Callable[[], float]) -> tuple[float, str]:
  """(value, where it came from): this machine's cached ``name``, else ``measure()``, stored."""
  path, key = os.path.join(cache_dir(), f'{name}.json'), machine_key()
  entries = _read(path)
  if isinstance(entries.get(key), dict) and 'value' in entries[key]:
    entry = entries[key]
    return float(entry['value']), (f'measured {entry.get("measured", "earlier")}, cached in '
                                   f'{path}; delete it to measure again')
  value = measure()
  # The load shows whether other processes shared the cores (a low measurement).
  entries[key] = {'value': value, 'measured': datetime.datetime.now().isoformat(' ', 'seconds')
                  + (f' at load average {os.getloadavg()[0]:.1f}' if hasattr(os, 'getloadavg')
                     else '')}
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + f'.{os.getpid()}.tmp', 'w', encoding='utf-8') as f:
      json.dump(entries, f, indent=1)
    os.replace(path + f'.{os.getpid()}.tmp', path)  # atomic: processes may start together
  except OSError as e:
    return value, f'measured now; not cached ({e})'
  return value, f'measured now, cached in {path}'


def _read(path: str) -> dict:
  """The file's entries; an unreadable or corrupt file counts as empty (it is rewritten)."""
  try:
    with open(path, encoding='utf-8') as f:
      entries = json.load(f)
  except (OSError, ValueError):
    return {}
  return entries if isinstance(entries, dict) else {}
