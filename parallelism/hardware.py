"""Hardware facts: the one table MFU, the cost model, the step model and launch.aot read.

Per device, from vendors' data sheets and public figures (each row names its
source): dense bf16 peak FLOP/s (on the CPU, whose fake devices share the
host's cores, the host's fp32 matmul rate, measured once per machine and
cached: peak_flops_per_device), HBM bandwidth, the HBM one compiled program
may use, interconnect link bandwidth, for TPUs how to name a slice to the
compiler (``launch.aot``) and the TensorCores and MXU width that price a Pallas
kernel (with ``PALLAS_STEP_SECONDS``), the compiler flags a run uses by default on
that chip, and the ``device_kind`` by which ``hardware.name='auto'`` recognizes it.

Link numbers: TPU ICI per link and direction (v4 and v5e 45 GB/s, v5p and
v6e 90 GB/s), a ring on one torus axis using one link per direction; NVLink 4
450 GB/s per direction per GPU. The CPU "links" are memory copies between
fake devices: synchronous, so nothing overlaps and the cost model never picks a ring.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp

GIB = 2 ** 30

# The XLA flags MaxText runs its measured v5p results with
# (MaxText/configs/v5p/*.sh): asynchronous collective fusions that overlap
# FSDP all-gathers and data-parallel reductions with compute. libtpu 0.0.42
# accepts each on v4, v5p, v5e and v6e (an unknown flag aborts the process;
# tests/test_tpu_aot.py compiles with them).
MAXTEXT_TPU_FLAGS = (
    '--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true',
    '--xla_tpu_megacore_fusion_allow_ags=false',
    '--xla_enable_async_collective_permute=true',
    '--xla_tpu_enable_ag_backward_pipelining=true',
    '--xla_tpu_enable_data_parallel_all_reduce_opt=true',
    '--xla_tpu_data_parallel_opt_different_sized_ops=true',
    '--xla_tpu_enable_async_collective_fusion=true',
    '--xla_tpu_enable_async_collective_fusion_multiple_steps=true',
    '--xla_tpu_overlap_compute_collective_tc=true',
    '--xla_enable_async_all_gather=true',
)

# XLA flags for overlapping collectives with compute on NVIDIA GPUs, from JAX's
# GPU performance tips and NVIDIA's JAX-Toolbox: the latency-hiding scheduler
# moves collectives to overlap compute; pipelining moves the FSDP all-gathers,
# reduce-scatters and all-reduces of a scanned layer loop into the iteration
# before (after) their use, with the loop double-buffered to make room; combining
# collectives by dimension is off so the pipelined ones are not merged back.
# jaxlib 0.10.2 knows each (XLA parses them on every backend: tests/test_runtime.py).
GPU_OVERLAP_FLAGS = (
    '--xla_gpu_enable_latency_hiding_scheduler=true',
    '--xla_gpu_enable_pipelined_all_gather=true',
    '--xla_gpu_enable_pipelined_reduce_scatter=true',
    '--xla_gpu_enable_pipelined_all_reduce=true',
    '--xla_gpu_enable_while_loop_double_buffering=true',
    '--xla_gpu_enable_all_gather_combine_by_dim=false',
    '--xla_gpu_enable_reduce_scatter_combine_by_dim=false',
)


# A Pallas kernel's grid step, on each TensorCore (parallelism/kernels.py), fitted to the
# one public measured table of Pallas block sizes: the JAX docs' "Pallas TPU: Matrix
# Multiplication" guide (docs/pallas/tpu/matmul.md, outputs unchanged since jax-ml/jax
# c504fa6a4a; configs/calibration/SOURCES.md 3A), bf16 matmuls of 1024^3, 4096^3 and
# 8192^3 on a v5e (one TensorCore, 197e12 FLOP/s) in blocks of 128x128x128 and of
# 512x1024x1024, timed with Python's dispatch. time = dispatch + grid steps x (step +
# a step's FLOPs / (peak x efficiency)) fits all six rows within 1.8% (a minimax fit,
# reproduced by tests/test_step_model.py) at a dispatch of 116 us, this step and an
# efficiency of 0.975 for both block shapes: the guide's small blocks lose their
# efficiency to the step's fixed cost (128^3 blocks: 0.35 us a step, 0.021 us of it MXU
# time), not to the MXU. Its largest blocks, steps and all, reach 0.93 of peak at 8192^3,
# its XLA matmul 0.94 (dispatch out): a kernel's block matmuls are priced as XLA's are
# (the step model's calibrated matmul efficiency), their steps on top.
PALLAS_STEP_SECONDS = 0.33e-6


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """How the TPU compiler names a slice of this chip (``v4:8x8x16``), and the two
  facts of its TensorCores that price a Pallas kernel (parallelism/kernels.py).

  ``tensorcores``: v4 and v5p chips have two (one device, "megacore"); Mosaic splits a
  kernel over them only along grid axes marked parallel, else runs it on one (the JAX
  Pallas TPU pipelining guide: "not specifying it will result in only one TensorCore
  being used"). ``mxu``: the matrix unit's width, 128 before v6e and 256 on v6e (the
  scaling book: "TPU v6e (Trillium) has a 256x256 MXU, while all previous generations use
  128x128"; configs/calibration/SOURCES.md 4A).
  """
  prefix: str                               # topology name prefix: 'v4', 'v5p', ...
  chip_config_name: str                     # 'megacore' (v4, v5p) or 'default'
  chips_per_host_bounds: tuple[int, int, int]
  tensorcores: int = 1                      # TensorCores a kernel may split over
  mxu: int = 128                            # MXU width (and height)


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """Per-device facts; see the module docstring for their sources."""
  name: str
  peak_flops: float       # FLOP/s; 0 means "measure at start" (CPU)
  source: str
  link_bandwidth: float   # bytes/s one link carries in one direction
  ring_links: int         # links a ring on one mesh axis uses per direction
  step_latency: float     # seconds of fixed cost per ring step (launch, sync)
  async_collectives: bool  # can a transfer overlap compute at all?
  # Does the compiler run an all-to-all asynchronously? The TPU programs compiled here
  # block on every all-to-all (docs/benchmarks.md: moe_1t), so expert chunks cannot
  # overlap their exchanges there; XLA's GPU backend runs them async by default
  # (--xla_gpu_enable_async_all_to_all).
  async_all_to_all: bool = False
  hbm_bandwidth: float = 0.0     # bytes/s; 0: not modeled (CPU)
  usable_hbm_bytes: float = 0.0  # what the compiler lets one program use
  tpu: TpuSlice | None = None    # set for TPU chips: how launch.aot names a slice
  # Default compiler flags on this chip: LIBTPU_INIT_ARGS on a TPU, XLA_FLAGS on a GPU.
  compiler_flags: tuple[str, ...] = ()
  platform: str = ''      # JAX's platform: 'cpu' | 'tpu' | 'gpu'
  device_kind: str = ''   # regular expression matching jax.Device.device_kind in full


PROFILES = {p.name: p for p in (
    HardwareProfile('cpu', 0.0, 'fp32 matmul measured at start / simulated devices',
                    10e9, 1, 20e-6, False, platform='cpu', device_kind='cpu'),
    # v4: 32 GiB HBM, of which the compiler gives one program 30.75 GiB (its own
    # figure in out-of-memory messages).
    HardwareProfile('tpu_v4', 275e12, 'TPU v4 data sheet, bf16 per chip', 45e9, 1, 2e-6, True,
                    hbm_bandwidth=1.2e12, usable_hbm_bytes=30.75 * GIB,
                    platform='tpu', device_kind=r'TPU v4',
                    tpu=TpuSlice('v4', 'megacore', (2, 2, 1), tensorcores=2),
                    compiler_flags=MAXTEXT_TPU_FLAGS),
    # v5p: the data sheet's "95 GB" of HBM2e is below what the compiler gives one program,
    # 95.74 GiB (its own figure in out-of-memory messages), which is what decides a fit.
    HardwareProfile('tpu_v5p', 459e12, 'TPU v5p data sheet, bf16 per chip', 90e9, 1, 2e-6, True,
                    hbm_bandwidth=2.765e12, usable_hbm_bytes=95.74 * GIB,
                    platform='tpu', device_kind=r'TPU v5p?',
                    tpu=TpuSlice('v5p', 'megacore', (2, 2, 1), tensorcores=2),
                    compiler_flags=MAXTEXT_TPU_FLAGS),
    # v5e and v6e: 2-D tori (v5e:4x4), 16 and 32 GiB HBM, same reserve assumed.
    HardwareProfile('tpu_v5e', 197e12, 'TPU v5e data sheet, bf16 per chip', 45e9, 1, 2e-6, True,
                    hbm_bandwidth=8.1e11, usable_hbm_bytes=14.75 * GIB,
                    platform='tpu', device_kind=r'TPU v5(e| lite)',
                    tpu=TpuSlice('v5e', 'default', (2, 2, 1)),
                    compiler_flags=MAXTEXT_TPU_FLAGS),
    HardwareProfile('tpu_v6e', 918e12, 'TPU v6e (Trillium) data sheet, bf16 per chip', 90e9, 1,
                    2e-6, True, hbm_bandwidth=1.64e12, usable_hbm_bytes=30.75 * GIB,
                    platform='tpu', device_kind=r'TPU v6(e| lite)',
                    tpu=TpuSlice('v6e', 'default', (2, 2, 1), mxu=256),
                    compiler_flags=MAXTEXT_TPU_FLAGS),
    HardwareProfile('h100', 989e12, 'H100 SXM data sheet, dense bf16', 450e9, 1, 5e-6, True,
                    hbm_bandwidth=3.35e12, usable_hbm_bytes=80e9, platform='gpu',
                    async_all_to_all=True, device_kind=r'NVIDIA H100.*',
                    compiler_flags=GPU_OVERLAP_FLAGS),
    HardwareProfile('h200', 989e12, 'H200 SXM data sheet, dense bf16', 450e9, 1, 5e-6, True,
                    hbm_bandwidth=4.8e12, usable_hbm_bytes=141e9, platform='gpu',
                    async_all_to_all=True, device_kind=r'NVIDIA H200.*',
                    compiler_flags=GPU_OVERLAP_FLAGS),
)}
TPU_PREFIXES = {p.tpu.prefix: p for p in PROFILES.values() if p.tpu}


def get_profile(name: str) -> HardwareProfile:
  if name not in PROFILES:
    raise ValueError(f'hardware.name={name!r} is not auto or one of {sorted(PROFILES)}')
  return PROFILES[name]


def compiler_flags(profile: HardwareProfile, setting: str = 'default') -> str:
  """The compiler flags a program for this chip is built with (LIBTPU_INIT_ARGS or XLA_FLAGS).

  ``setting`` is ``hardware.xla_flags``: 'default' (the chip's row above),
  'default --a=1 ...' (the chip's row, then these), 'none', or a
  space-separated list used instead of the defaults.
  """
  check_flags(setting)
  words = setting.split()
  if words[:1] == ['default']:
    return ' '.join(profile.compiler_flags + tuple(words[1:]))
  return '' if words == ['none'] else setting


def check_flags(setting: str) -> None:
  """Raises ValueError naming the first word of ``hardware.xla_flags`` that is not a flag."""
  words = setting.split()
  if words[:1] == ['none'] and words[1:]:
    raise ValueError(f"hardware.xla_flags={setting!r}: 'none' takes no flags after it")
  for word in words[1:] if words[:1] in (['default'], ['none']) else words:
    if not re.fullmatch(r'--\w+(=\S*)?', word):
      raise ValueError(f"hardware.xla_flags: {word!r} is not a flag of the form --name=value "
                       "(use 'default', 'default --a=1 ...', 'none' or a list of flags)")


def startup_flags(name: str, platform: str, setting: str = 'default') -> str:
  """The compiler flags to put in the environment before JAX starts on ``platform``.

  Named chips use their row's; 'auto' (the chip is known only once JAX has
  started, too late for flags) uses its platform's, which all that platform's
  rows share (tests/test_runtime.py checks). None on the CPU.
  """
  if platform == 'cpu':
    return ''
  rows = [p for p in PROFILES.values() if p.platform == platform]
  return compiler_flags(get_profile(name) if name != 'auto' else rows[0], setting)


def detect(name: str, kinds: list[str]) -> HardwareProfile:
  """The profile of ``hardware.name`` on devices of these kinds (``jax.Device.device_kind``).

  'auto' picks the row whose ``device_kind`` matches; a named chip must match
  the devices. Raises ValueError naming both otherwise.
  """
  found = [p for p in PROFILES.values()
           if p.device_kind and all(re.fullmatch(p.device_kind, k) for k in kinds)]
  devices = f'{len(kinds)} x {kinds[0]!r}' if len(set(kinds)) == 1 else repr(sorted(set(kinds)))
  if name == 'auto' and found:
    return found[0]
  if name == 'auto':
    raise ValueError(f'hardware.name=auto: no row of parallelism/hardware.py describes the '
                     f'devices ({devices}); add one (peak FLOP/s, bandwidths, device_kind)')
  if get_profile(name) in found:
    return get_profile(name)
  raise ValueError(f'hardware.name={name!r} does not match the devices ({devices}, ' + (
      f'which are {found[0].name}); use hardware.name=auto' if found else
      'which no row of parallelism/hardware.py describes); add one'))


def measure_host_matmul_flops(sizes=(512, 1024, 2048), repeats: int = 10) -> float:
  """Best fp32 FLOP/s of n x n matmuls on one CPU device (which uses all cores).

  The best over several sizes and repeats: one size's rate depends on the cache
  sizes, and any repeat can be slowed by other processes, never sped up.
  """
  device = jax.local_devices(backend='cpu')[0]  # this process's: another's would not run here
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
