"""The device mesh: named axes, sizes from config, one ``-1`` auto-filled.

Axis type: every axis is ``AxisType.Auto`` (classic GSPMD propagation). Reason:
model code names logical axes only and the parallelism layer places
constraints at layer boundaries; with ``Explicit`` axes every einsum whose
output sharding is ambiguous would have to name an ``out_sharding``, which
would pull mesh axes into model code. Decomposed collective einsums use
``jax.shard_map`` with explicit in/out specs, which behaves the same under
either axis type, so nothing is lost by choosing Auto here.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np

AXES = ('data', 'fsdp', 'tensor', 'expert')


def mesh_sizes(mesh_cfg: Any, num_devices: int) -> dict[str, tuple[int, int]]:
  """Resolves ``mesh.*`` into ``{axis: (dcn_size, ici_size)}``.

  In-slice (ICI) sizes may contain one ``-1``, filled so that the product of
  all sizes equals ``num_devices``; across-slice (``dcn_*``) sizes are explicit.
  The size of an axis in the global mesh is ``dcn_size * ici_size``.

  Raises:
    ValueError: naming the offending values when the sizes cannot cover
      exactly ``num_devices`` devices.
  """
  ici = {a: int(mesh_cfg[a]) for a in AXES}
  dcn = {a: int(mesh_cfg[f'dcn_{a}']) for a in AXES}
  desc = ', '.join(f'mesh.{a}={v}' for a, v in ici.items())
  bad = [f'mesh.{a}={v}' for a, v in ici.items() if v == 0 or v < -1]
  bad += [f'mesh.dcn_{a}={v}' for a, v in dcn.items() if v < 1]
  if bad:
    raise ValueError(f'mesh sizes must be positive (or -1 to fill): {", ".join(bad)}')
  auto = [a for a, v in ici.items() if v == -1]
  if len(auto) > 1:
    raise ValueError(f'at most one mesh size may be -1, got {desc}')
  known = math.prod(v for v in ici.values() if v != -1) * math.prod(dcn.values())
  if auto:
    if num_devices % known:
      raise ValueError(f'cannot fill mesh.{auto[0]}=-1: {num_devices} devices are '
                       f'not divisible by the other sizes ({desc})')
    ici[auto[0]] = num_devices // known
  elif known != num_devices:
    raise ValueError(f'mesh size product {known} ({desc}, dcn sizes '
                     f'{tuple(dcn.values())}) != device count {num_devices}')
  return {a: (dcn[a], ici[a]) for a in AXES}


def make_mesh(mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """Builds the global mesh with axes ``AXES`` (all of type Auto)."""
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_sizes(mesh_cfg, len(devices))
  ici_shape = [sizes[a][1] for a in AXES]
  dcn_shape = [sizes[a][0] for a in AXES]
  axis_types = (jax.sharding.AxisType.Auto,) * len(AXES)
  if math.prod(dcn_shape) == 1:
    return jax.make_mesh(ici_shape, AXES, axis_types=axis_types, devices=devices)
  if not hasattr(devices[0], 'slice_index'):
    raise ValueError(f'mesh.dcn_* sizes {tuple(dcn_shape)} need a multi-slice '
                     f'platform; {devices[0].platform} devices have no slice_index')
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices)
  return jax.sharding.Mesh(np.asarray(grid), AXES, axis_types=axis_types)


def describe(mesh: jax.sharding.Mesh) -> str:
  return ' x '.join(f'{name}={size}' for name, size in mesh.shape.items())
