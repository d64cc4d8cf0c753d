"""What a run reports: where the wall time goes, device memory, the CPU peak behind
MFU (measured once per machine), and the parallelism summary."""

import json
import re
import types

import pytest

from parallelism import hardware, host_cache, report, sharding
from trainer import metrics


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_stopwatch_charges_laps_and_sums_to_the_wall_time(monkeypatch):
  fake = FakeClock()
  monkeypatch.setattr(metrics.time, 'perf_counter', fake)
  clock = metrics.Stopwatch()
  for category, seconds in (('setup', 2.0), ('compile', 5.0), ('data_wait', 0.5),
                            ('device_step', 3.0), ('eval', 1.0), ('device_step', 3.5)):
    fake.now += seconds
    assert clock.lap(category) == seconds
  assert clock.take() == {'setup_s': 2.0, 'compile_s': 5.0, 'data_wait_s': 0.5,
                          'device_step_s': 6.5, 'eval_s': 1.0}  # in CATEGORIES order
  fake.now += 1.0
  clock.lap('checkpoint')
  assert clock.take() == {'checkpoint_s': 1.0}  # a new window
  summary = clock.summary()
  assert summary['goodput'] == 6.5 / 16.0 and summary['total_device_step_s'] == 6.5
  assert sum(v for k, v in summary.items() if k.startswith('total_')) == clock.elapsed() == 16.0
  with pytest.raises(AssertionError):
    clock.lap('typo')


def test_device_memory_where_the_backend_reports_it(monkeypatch):
  assert metrics.device_memory() == {}  # the CPU reports none
  gib = 2 ** 30
  devices = [types.SimpleNamespace(memory_stats=lambda s=s: s) for s in (
      {'bytes_in_use': gib, 'peak_bytes_in_use': 3 * gib, 'bytes_limit': 80 * gib},
      {'bytes_in_use': 2 * gib, 'peak_bytes_in_use': 2 * gib, 'bytes_limit': 80 * gib})]
  monkeypatch.setattr(metrics.jax, 'local_devices', lambda: devices)
  memory = metrics.device_memory()
  assert memory == {'memory_peak_gib': 3.0, 'memory_limit_gib': 80.0}
  line = metrics._train_line({'loss': 2.0, 'tokens_per_sec': 1e3, 'mfu': 0.5, **memory})
  assert line == 'loss 2.0000 | 1,000 tok/s | mfu 50.00% | mem 3.0/80.0 GiB'


def test_cpu_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  calls = []
  measure = lambda: calls.append(1) or 2e11
  value, note = host_cache.cached('peak', measure)
  assert value == 2e11 and 'measured now, cached in' in note and len(calls) == 1
  path = tmp_path / 'ringtrain' / 'peak.json'
  assert list(json.loads(path.read_text())) == [host_cache.machine_key()]
  assert host_cache.cached('peak', lambda: 1.0)[0] == 2e11  # the next start: cached
  monkeypatch.setattr(host_cache, 'machine_key', lambda: 'another CPU')
  assert host_cache.cached('peak', lambda: 1.0)[0] == 1.0  # another machine: measured
  assert len(json.loads(path.read_text())) == 2
  path.write_text('{not json')
  assert host_cache.cached('peak', lambda: 3.0)[0] == 3.0  # corrupt: measured again
  monkeypatch.setenv('XDG_CACHE_HOME', str(path))  # a file: the cache cannot be written
  value, note = host_cache.cached('peak', lambda: 4.0)
  assert value == 4.0 and 'not cached' in note


def test_cpu_peak_per_device_comes_from_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  assert hardware.measure_host_matmul_flops(sizes=(64, 128), repeats=2) > 1e6
  monkeypatch.setattr(hardware, 'measure_host_matmul_flops', lambda: 8e10)
  peak, source = hardware.peak_flops_per_device('cpu', 0.0, 8)
  assert peak == 1e10 and '80.0 GFLOP/s, / 8 devices; measured now' in source
  monkeypatch.setattr(hardware, 'measure_host_matmul_flops', lambda: 1e9)
  assert hardware.peak_flops_per_device('cpu', 0.0, 8)[0] == 1e10  # cached: stable
  assert hardware.peak_flops_per_device('cpu', 5e9, 8)[0] == 5e9  # hardware.peak_flops


def _row(path, decision, seconds=None):
  return {'path': path, 'einsum': 'btd,df->btf', 'sharded_dims': '-', 'collective': 'c',
          'decision': decision, 'modeled_step_compute_us': None,
          'modeled_step_transfer_us': None, 'modeled_seconds': seconds}


def test_parallelism_summary_counts_decisions_and_names_the_costliest(tmp_path, capsys):
  rows = [_row('a', 'none', {'none': 1e-6, 'unidirectional': 5e-6}),
          _row('b', 'unidirectional', {'none': 9e-6, 'unidirectional': 4e-6}),
          _row('c', 'unidirectional', {'none': 9e-6, 'unidirectional': 7e-6}),
          _row('d', 'none'),  # no collective needed: nothing modeled
          {'path': 'e.moe.exchange', 'decision': 'chunked x2', 'modeled_single_us': 9.0,
           'modeled_chunked_us': 6.0}]
  # a plain forward whose weight gradient rings (layer_overrides '...=gradients'): decomposed
  rows.insert(3, _row('f', 'none') | {
      'gradients': {'lhs': 'none', 'rhs': 'bidirectional over fsdp'},
      'modeled_gradient_seconds': {'rhs': {'one einsum': 6.39e-3,
                                           'bidirectional over fsdp': 4.982e-3}}})
  rows[1] |= {'gradients': {'lhs': 'ring', 'rhs': 'none'},
              'modeled_gradient_seconds': {'lhs': {'one einsum': 9e-3,
                                                   'unidirectional over c': 5e-3}}}
  policy = sharding.MatmulPolicy('auto', hardware='tpu_v4')
  lines = report.summary(rows, policy, str(tmp_path / 'parallelism_report.json'),
                         costliest=2).splitlines()
  assert lines[0] == ('parallelism: collective_matmul=auto, 3/5 dense layers decomposed, '
                      '1/1 expert all-to-alls chunked (times modeled for tpu_v4)')
  assert lines[1] == '  decisions: none 3, unidirectional 2, chunked x2 1'
  assert lines[2] == '  costliest (modeled): c 7.0 us, e.moe.exchange 6.0 us'
  assert lines[3].endswith(f'(as a table: python -m parallelism.report {tmp_path})')
  report.write(str(tmp_path / 'parallelism_report.json'), rows[:5], policy)
  assert report.main([str(tmp_path)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].split()[:2] == ['layer', 'einsum'] and len(out) == 2 + 5
  # the last column, each ring's schedule, is '-' where a row records none
  cells = [re.split(r'\s{2,}', l) for l in out]
  assert cells[2 + 3][-2:] == ['lhs none; rhs bidirectional over fsdp 4.98 ms (one einsum '
                               '6.39)', '-'], out
  assert cells[2 + 1][-2:] == ['lhs ring 5.00 ms (one einsum 9.00); rhs none', '-'], out
  assert cells[2][-2:] == ['-', '-'], out  # no gradients reported
  assert report.main([str(tmp_path / 'missing.json')]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith('error: ') and 'missing.json' in err
