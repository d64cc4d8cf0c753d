"""Mesh construction and logical-axis rules."""

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.transformer import Transformer, TransformerConfig
from parallelism import mesh as mesh_lib, sharding


def _mesh_cfg(**kw):
  base = dict(data=1, fsdp=1, tensor=1, expert=1, dcn_data=1, dcn_fsdp=1,
              dcn_tensor=1, dcn_expert=1)
  return {**base, **kw}


def test_minus_one_is_filled():
  sizes = mesh_lib.mesh_sizes(_mesh_cfg(data=-1, tensor=4), 8)
  assert sizes == {'data': (1, 2), 'fsdp': (1, 1), 'tensor': (1, 4), 'expert': (1, 1)}
  sizes = mesh_lib.mesh_sizes(_mesh_cfg(fsdp=-1, dcn_data=2), 8)
  assert sizes['fsdp'] == (1, 4) and sizes['data'] == (2, 1)


@pytest.mark.parametrize('cfg, message', [
    (_mesh_cfg(data=3), 'mesh size product 3'),
    (_mesh_cfg(data=-1, tensor=3), 'cannot fill mesh.data=-1'),
    (_mesh_cfg(data=0), 'mesh.data=0'),
    (_mesh_cfg(dcn_fsdp=0), 'mesh.dcn_fsdp=0'),
])
def test_bad_mesh_sizes(cfg, message):
  with pytest.raises(ValueError, match=message):
    mesh_lib.mesh_sizes(cfg, 8)


def test_mesh_is_auto_with_named_axes(devices):
  mesh = mesh_lib.make_mesh(_mesh_cfg(data=2, tensor=-1), devices)
  assert mesh.axis_names == ('data', 'fsdp', 'tensor', 'expert')
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 1, 'tensor': 4, 'expert': 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_first_fit_rules():
  rules = sharding.normalize_rules([['batch', ['data', 'fsdp']], ['embed', 'fsdp'],
                                    ['embed', 'tensor'], ['mlp', 'tensor'], ['x', None]])
  assert sharding.logical_to_spec(('batch', 'length', 'embed'), rules) == P(
      ('data', 'fsdp'), None, 'tensor')
  assert sharding.logical_to_spec(('embed', 'mlp'), rules) == P('fsdp', 'tensor')
  assert sharding.logical_to_spec(('x', 'unknown'), rules) == P(None, None)
  with pytest.raises(ValueError, match='not a \\[logical, mesh_axes\\] pair'):
    sharding.normalize_rules([['batch']])


def test_indivisible_parameter_is_named(devices):
  mesh = mesh_lib.make_mesh(_mesh_cfg(tensor=8), devices)
  rules = sharding.normalize_rules([['heads', 'tensor']])
  cfg = TransformerConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=4,
                          head_dim=8, mlp_dim=64, vocab_size=64)
  _, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  with pytest.raises(ValueError, match=r"q_dnh dim 4 over tensor \(8\)"):
    sharding.check_divisible(params, sharding.state_specs(params, rules), mesh)
