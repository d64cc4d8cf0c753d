"""Hardware profiles: the numbers MFU and (later) the collective cost model use.

Peak FLOP/s are per device, for the dense matmul dtype a run would use there
(bf16 on accelerators), from the vendors' data sheets. The CPU has no fixed
peak: it is measured at start as the best fp32 matmul rate of the whole host
(all fake devices share its cores), divided by the number of simulated devices.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """Per-device numbers; link numbers feed the collective-einsum cost model."""
  name: str
  peak_flops: float       # FLOP/s; 0 means "measure at start" (CPU)
  source: str
  link_bandwidth: float   # bytes/s one link carries in one direction
  ring_links: int         # links a ring on one mesh axis uses per direction
  step_latency: float     # seconds of fixed cost per ring step (launch, sync)
  async_collectives: bool  # can a transfer overlap compute at all?


# Link numbers are public figures (TPU v4/v5p ICI: 45/90 GB/s per link and
# direction, a ring on a torus axis using one link per direction; NVLink 4:
# 450 GB/s per direction per GPU). The CPU "links" are memory copies between
# fake devices: synchronous, so nothing overlaps and decomposition never pays.
PROFILES = {
    'cpu': HardwareProfile('cpu', 0.0, 'fp32 matmul measured at start / simulated devices',
                           10e9, 1, 20e-6, False),
    'tpu_v4': HardwareProfile('tpu_v4', 275e12, 'TPU v4 data sheet, bf16 per chip',
                              45e9, 1, 2e-6, True),
    'tpu_v5p': HardwareProfile('tpu_v5p', 459e12, 'TPU v5p data sheet, bf16 per chip',
                               90e9, 1, 2e-6, True),
    'h100': HardwareProfile('h100', 989e12, 'H100 SXM data sheet, dense bf16',
                            450e9, 1, 5e-6, True),
    'h200': HardwareProfile('h200', 989e12, 'H200 SXM data sheet, dense bf16',
                            450e9, 1, 5e-6, True),
}


def get_profile(name: str) -> HardwareProfile:
  if name not in PROFILES:
    raise ValueError(f'hardware.name={name!r} is not one of {sorted(PROFILES)}')
  return PROFILES[name]


def measure_host_matmul_flops(sizes=(512, 1024, 2048), repeats: int = 10) -> float:
  """Best fp32 FLOP/s of n x n matmuls on one CPU device (which uses all cores).

  The best over several sizes and repeats: one size's rate depends on the cache
  sizes, and any repeat can be slowed by other processes, never sped up.
  """
  device = jax.devices('cpu')[0]
  matmul = jax.jit(lambda x: x @ x)
  best = 0.0
  for n in sizes:
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    matmul(a).block_until_ready()  # compile
    for _ in range(repeats):
      start = time.perf_counter()
      matmul(a).block_until_ready()
      best = max(best, 2 * n ** 3 / (time.perf_counter() - start))
  return best


def peak_flops_per_device(name: str, override: float, num_devices: int) -> tuple[float, str]:
  """Returns (peak FLOP/s per device, where it came from).

  The CPU's is the host's best matmul rate (measured once per machine, then
  cached: parallelism/host_cache.py) divided by the simulated devices.
  """
  if override > 0:
    return override, 'hardware.peak_flops override'
  profile = get_profile(name)
  if profile.peak_flops:
    return profile.peak_flops, profile.source
  from parallelism import host_cache  # pylint: disable=g-import-not-at-top
  host, note = host_cache.cached('cpu_matmul_flops', measure_host_matmul_flops)
  return host / num_devices, (f'best fp32 matmul of the host, {host / 1e9:.1f} GFLOP/s, '
                              f'/ {num_devices} devices; {note}')
