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
