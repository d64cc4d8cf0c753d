"""Process set-up: device count from the environment, XLA flags."""

import os

import pytest

from launch import runtime


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
