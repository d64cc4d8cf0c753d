"""Process set-up: device count from the environment, the platform, compiler flags."""

import os
import subprocess
import sys

import pytest

from trainer import runtime
from parallelism import hardware
from tests.conftest import ROOT


def test_cpu_device_count_env_wins_over_config(monkeypatch):
  monkeypatch.delenv(runtime.CPU_DEVICES_ENV, raising=False)
  assert runtime.cpu_device_count(8) == 8
  monkeypatch.setenv(runtime.CPU_DEVICES_ENV, '4')
  assert runtime.cpu_device_count(8) == 4
  monkeypatch.setenv(runtime.CPU_DEVICES_ENV, 'four')
  with pytest.raises(ValueError, match="RINGTRAIN_CPU_DEVICES='four'"):
    runtime.cpu_device_count(8)


def test_collective_timeouts_are_raised_once(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_collective_timeout_seconds=30')
  runtime.add_xla_flags()
  runtime.add_xla_flags()
  flags = os.environ['XLA_FLAGS'].split()
  assert flags.count('--xla_cpu_collective_timeout_seconds=30') == 1  # the user's value stays
  assert '--xla_cpu_collective_call_terminate_timeout_seconds=600' in flags
  assert len(flags) == len(set(flags)) == 3


@pytest.mark.parametrize('requested, platform', [
    ('cpu', 'cpu'), ('tpu,cpu', 'tpu'), ('cuda', 'gpu'), ('GPU', 'gpu')])
def test_jax_platforms_decides_the_platform(monkeypatch, requested, platform):
  monkeypatch.setenv('JAX_PLATFORMS', requested)
  assert runtime.probe_platform() == platform


def test_platform_probe_without_jax_platforms(tmp_path, monkeypatch):
  """A TPU chip on the PCI bus, else an NVIDIA device file, else the CPU."""
  monkeypatch.delenv('JAX_PLATFORMS')
  (tmp_path / 'pci' / '0000:00:04.0').mkdir(parents=True)
  vendor = tmp_path / 'pci' / '0000:00:04.0' / 'vendor'
  vendor.write_text('0x8086\n')
  monkeypatch.setattr(runtime, 'PCI_VENDOR_FILES', str(tmp_path / 'pci' / '*' / 'vendor'))
  monkeypatch.setattr(runtime, 'NVIDIA_DEVICE_FILES', (str(tmp_path / 'nvidia0'),))
  assert runtime.probe_platform() == 'cpu'
  (tmp_path / 'nvidia0').write_text('')
  assert runtime.probe_platform() == 'gpu'
  vendor.write_text('0x1ae0\n')
  assert runtime.probe_platform() == 'tpu'
  monkeypatch.setenv('JAX_PLATFORMS', 'rocm')
  with pytest.raises(ValueError, match="JAX_PLATFORMS='rocm'"):
    runtime.probe_platform()


@pytest.mark.parametrize('kind, name', [
    ('cpu', 'cpu'), ('TPU v4', 'tpu_v4'), ('TPU v5', 'tpu_v5p'), ('TPU v5p', 'tpu_v5p'),
    ('TPU v5 lite', 'tpu_v5e'), ('TPU v6 lite', 'tpu_v6e'),
    ('NVIDIA H100 80GB HBM3', 'h100'), ('NVIDIA H200', 'h200')])
def test_auto_detects_the_chip_by_device_kind(kind, name):
  assert hardware.detect('auto', [kind] * 4).name == name
  assert hardware.detect(name, [kind] * 4).name == name


def test_a_name_that_does_not_match_the_devices_is_refused_naming_both():
  with pytest.raises(ValueError, match=r"hardware.name='h100' does not match the devices "
                                       r"\(8 x 'cpu', which are cpu\)"):
    hardware.detect('h100', ['cpu'] * 8)
  with pytest.raises(ValueError, match="no row.*'NVIDIA A100-SXM4-80GB'"):
    hardware.detect('auto', ['NVIDIA A100-SXM4-80GB'])


def test_compiler_flags_per_platform_set_before_jax_starts(monkeypatch):
  """One place sets them: LIBTPU_INIT_ARGS on a TPU, XLA_FLAGS on a GPU, nothing on the CPU."""
  for platform in ('tpu', 'gpu'):  # 'auto' knows only the platform: its rows must agree
    rows = {p.compiler_flags for p in hardware.PROFILES.values() if p.platform == platform}
    assert len(rows) == 1 and rows.pop()
  gpu = hardware.startup_flags('auto', 'gpu')
  assert '--xla_gpu_enable_latency_hiding_scheduler=true' in gpu.split()
  assert hardware.startup_flags('auto', 'tpu') == ' '.join(hardware.MAXTEXT_TPU_FLAGS)
  assert hardware.startup_flags('h100', 'cpu') == hardware.startup_flags('auto', 'cpu') == ''
  assert hardware.startup_flags('h200', 'gpu', 'none') == ''
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_enable_pipelined_all_gather=false')
  monkeypatch.setenv('LIBTPU_INIT_ARGS', '--mine=1')
  runtime.configure_host(8, platform='gpu', compiler_flags=gpu)
  flags = os.environ['XLA_FLAGS'].split()
  assert '--xla_gpu_enable_pipelined_all_gather=false' in flags  # the user's stays
  assert '--xla_gpu_enable_pipelined_all_gather=true' not in flags
  assert '--xla_gpu_enable_latency_hiding_scheduler=true' in flags
  assert os.environ['LIBTPU_INIT_ARGS'] == '--mine=1'
  runtime.configure_host(8, platform='tpu', compiler_flags='--a=1')
  assert os.environ['LIBTPU_INIT_ARGS'] == '--a=1 --mine=1'


def test_xla_knows_the_gpu_flags():
  """XLA parses XLA_FLAGS on every backend and aborts on an unknown flag: check on the CPU."""
  env = dict(os.environ, XLA_FLAGS=hardware.startup_flags('auto', 'gpu'), JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-c', 'import jax; jax.jit(lambda x: x + 1)(1.0)'],
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_cuda12_extra_follows_the_jax_pin():
  """jax[cuda12] pins jax-cuda12-plugin to jax's exact version; constraints.txt agrees."""
  with open(os.path.join(ROOT, 'setup.py'), encoding='utf-8') as f:
    assert "'cuda12': ['jax[cuda12]>=" in f.read()
  with open(os.path.join(ROOT, 'constraints.txt'), encoding='utf-8') as f:
    pins = dict(line.strip().split('==') for line in f if '==' in line and line[0] != '#')
  assert pins['jax-cuda12-plugin'] == pins['jax-cuda12-pjrt'] == pins['jax'] == pins['jaxlib']
