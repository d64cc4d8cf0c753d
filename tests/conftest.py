"""Test set-up: 8 simulated CPU devices and a persistent compilation cache."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('RINGTRAIN_COMPILATION_CACHE', os.path.join(ROOT, '.cache', 'jax'))
os.environ.pop('RINGTRAIN_CPU_DEVICES', None)
# Tests that compile for a TPU ahead of time may run side by side (make test runs two
# pytest workers): libtpu's one-process lock file guards a real chip, and here there is none.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')

from trainer import runtime  # pylint: disable=wrong-import-position

# The tests' programs are tiny: LLVM optimizing their CPU code takes longer than the code
# then runs (compiles 2-4x faster at level 0; test_multihost's checkpoints test 55 s -> 40 s).
# XLA's own passes still run: the same HLO, less optimized machine code. Subprocesses inherit
# it through XLA_FLAGS; the TPU compiles (launch.aot, tpu_aot_probe) run without XLA_FLAGS.
runtime.add_xla_flags(('--xla_backend_optimization_level=0',))
runtime.configure_host(8)

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position
from hypothesis import settings  # pylint: disable=wrong-import-position

settings.register_profile('ci', deadline=None, max_examples=10, derandomize=True)
settings.load_profile('ci')


@pytest.fixture(scope='session')
def devices():
  assert jax.device_count() == 8, jax.devices()
  return jax.devices()
