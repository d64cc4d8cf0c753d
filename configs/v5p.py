r"""The four paper configs on TPU v5p slices of the same chip counts.

  python -m launch.aot --config configs/v5p.py:dense_500b

The argument names one of ``configs/dense_10b.py``, ``dense_64b.py``,
``dense_500b.py`` and ``moe_1t.py``: the same model, mesh, batch and settings,
compiled for a v5p slice of as many chips (``v5p:4x4x8``: 128, ``v5p:8x8x8``:
512, ``v5p:8x8x16``: 1024; 3-D tori like v4's) and modeled with the
``tpu_v5p`` row of ``parallelism/hardware.py`` (459 TFLOP/s, 2.77 TB/s of HBM,
90 GB/s links, 95.74 GiB usable per program).
"""

import importlib

import ml_collections

SLICES = {'dense_10b': 'v5p:4x4x8', 'dense_64b': 'v5p:8x8x8', 'dense_500b': 'v5p:8x8x16',
          'moe_1t': 'v5p:8x8x16'}


def get_config(name: str = 'dense_500b') -> ml_collections.ConfigDict:
  if name not in SLICES:
    raise ValueError(f'the argument is one of {sorted(SLICES)}')  # the loader names it
  c = importlib.import_module(f'configs.{name}').get_config()
  c.hardware.name = 'tpu_v5p'
  c.aot.topology = SLICES[name]
  return c
