"""Reading HLO text: device groups in every printed format, collectives over a mesh axis."""

import pytest

from parallelism import hlo_text, mesh as mesh_lib


@pytest.mark.parametrize('attrs, groups', [
    ('replica_groups={{0,2},{1,3}}', [[0, 2], [1, 3]]),
    ('replica_groups=[2,2]<=[4]', [[0, 1], [2, 3]]),
    ('replica_groups=[2,2]<=[2,2]T(1,0)', [[0, 2], [1, 3]]),
    # digits in axis names are names, not sizes
    ("replica_groups=mesh['data2'=2,'tensor4'=2] {'tensor4'}", [[0, 1], [2, 3]]),
    ("replica_groups=mesh['data2'=2,'tensor4'=2] {'data2'}", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a1'=2,'b2'=2], device_ids=([2,2]T(1,0)) {'b2'}", [[0, 2], [1, 3]]),
    ('dimensions={0}', [[0, 1, 2, 3]]),
])
def test_replica_groups(attrs, groups):
  assert hlo_text.replica_groups(attrs, 4) == groups
  assert hlo_text.first_group(attrs, 4) == groups[0]


HLO = """HloModule m, num_partitions=8

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %ag = f32[16]{0} all-gather(%p), replica_groups=[4,2]<=[8], dimensions={0}, metadata={op_name="jit(f)/mlp.up/x"}
  %ar = f32[8]{0} all-reduce(%p), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add
  ROOT %cp = f32[8]{0} collective-permute(%p), source_target_pairs={{0,2},{2,4},{4,6},{6,0}}
}
"""


def test_collectives_over_an_axis_and_permute_offsets(devices):
  mesh = mesh_lib.make_mesh(dict(data=4, fsdp=1, tensor=2, expert=1, dcn_data=1, dcn_fsdp=1,
                                 dcn_tensor=1, dcn_expert=1), devices)
  module = hlo_text.parse(HLO)
  assert hlo_text.collectives_over(module, mesh, 'tensor') == ['ag']
  assert hlo_text.collectives_over(module, mesh, 'data') == ['ar']
  assert hlo_text.collectives_over(module, mesh, 'tensor', lambda n: 'attn' in n) == []
  assert hlo_text.permute_offsets(module, mesh, 'data') == [1]


def test_collective_counts_by_kind_sync_or_async():
  module = hlo_text.parse(HLO.replace(
      '  ROOT %cp', '  %rs = f32[4]{0} reduce-scatter-start(%p), replica_groups=[4,2]<=[8], '
      'dimensions={0}, to_apply=%add\n  ROOT %cp'))
  assert hlo_text.collective_counts(module) == {
      'all-gather': 1, 'all-reduce': 1, 'collective-permute': 1, 'reduce-scatter': 1}
