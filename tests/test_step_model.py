"""The analytical step model on hand-built schedules with known answers."""

import pytest

from parallelism import hlo_text, step_model

# A ring step in a loop: a permute in flight over one matmul, three times, then a
# synchronous all-gather over 4 chips.
HAND_BUILT = """HloModule hand, is_scheduled=true, num_partitions=4

%fused_matmul (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (loop: (s32[], bf16[64,128], bf16[128,256])) -> (s32[], bf16[64,128], bf16[128,256]) {
  %loop = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %x = bf16[64,128]{1,0} get-tuple-element(%loop), index=1
  %w = bf16[128,256]{1,0} get-tuple-element(%loop), index=2
  %cp-start = (bf16[64,128]{1,0}, bf16[64,128]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name="collective_einsum/ring"}
  %mm = bf16[64,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul
  %cp-done = bf16[64,128]{1,0} collective-permute-done(%cp-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%next, %cp-done, %w)
}

%cond (loop: (s32[], bf16[64,128], bf16[128,256])) -> pred[] {
  %loop = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[64,128], w: bf16[128,256]) -> bf16[256,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%zero, %x, %w)
  %ring = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) while(%init), condition=%cond, body=%body
  %y = bf16[64,128]{1,0} get-tuple-element(%ring), index=1
  ROOT %ag = bf16[256,128]{1,0} all-gather(%y), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
}
"""

CHIP = step_model.Chip('test', peak_flops=1e12, hbm_bandwidth=1e11, link_bandwidth=1e9,
                       ring_links=1, step_latency=0.0)


def test_hand_built_schedule():
  r = step_model.analyze(HAND_BUILT, CHIP)
  matmul = 2 * 64 * 256 * 128 / 1e12          # 4.19 us: compute-bound (114,688 bytes: 1.15 us)
  permute = 64 * 128 * 2 / 1e9                # 16.38 us over one link
  add = (4 + 4 + 4) / 1e11                    # the loop counter
  compare = (4 + 4 + 1) / 1e11                # the condition, run 4 times
  all_gather = 256 * 128 * 2 * 3 / 4 / (2 * 1e9)  # 3/4 of the output over both ring directions
  assert r.warnings == []
  assert r.flops == 3 * 2 * 64 * 256 * 128
  assert r.compute_seconds == pytest.approx(3 * (matmul + add) + 4 * compare)
  assert r.comm_seconds == pytest.approx(3 * permute + all_gather)
  # Each permute hides behind the matmul and waits out the rest; the all-gather blocks.
  assert r.exposed_comm_seconds == pytest.approx(3 * (permute - matmul) + all_gather)
  assert r.step_seconds == pytest.approx(3 * (permute + add) + 4 * compare + all_gather)
  assert r.collectives == {
      'all-gather': {'count': 1, 'seconds': pytest.approx(all_gather)},
      'collective-permute (async)': {'count': 3, 'seconds': pytest.approx(3 * permute)}}
  [pair] = r.pairs
  assert (pair['start'], pair['done'], pair['executions']) == ('cp-start', 'cp-done', 3)
  assert pair['einsums_between'] == ['mm']
  assert pair['compute_between_us'] == pytest.approx(matmul * 1e6)
  assert pair['exposed_us'] == pytest.approx((permute - matmul) * 1e6)


def test_compute_hides_the_transfer_when_it_is_longer():
  slow = step_model.Chip('slow', peak_flops=1e11, hbm_bandwidth=1e11, link_bandwidth=1e9,
                         ring_links=1, step_latency=0.0)
  r = step_model.analyze(HAND_BUILT, slow)
  matmul = 2 * 64 * 256 * 128 / 1e11  # 41.9 us > the 16.4 us permute
  assert r.pairs[0]['exposed_us'] == 0
  all_gather = 256 * 128 * 2 * 3 / 4 / (2 * 1e9)
  assert r.exposed_comm_seconds == pytest.approx(all_gather)
  assert r.step_seconds > 3 * matmul + all_gather


def test_tpu_batched_matmul_convolution_flops():
  # How the TPU compiler writes btd,dnh->btnh: the head dim as a padded window.
  ins = hlo_text.parse_instr(
      '  %c = f32[4,128,10,128]{3,1,2,0} convolution(%a, %b), window={size=1x10 pad=0_0x9_9 '
      'rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f')
  shapes = {'a': 'bf16[4,128,20480,1]', 'b': 'bf16[20480,10,128,1]'}
  assert step_model.conv_flops(ins, shapes) == 2 * (4 * 128) * 20480 * (10 * 128)


def test_trip_count_with_a_counter_stepping_by_two():
  text = HAND_BUILT.replace('%one = s32[] constant(1)', '%one = s32[] constant(2)').replace(
      '%n = s32[] constant(3)', '%n = s32[] constant(6)')
  r = step_model.analyze(text, CHIP)
  assert r.pairs[0]['executions'] == 3 and r.flops == 3 * 2 * 64 * 256 * 128


@pytest.mark.parametrize('attrs,group', [
    ('replica_groups={{0,2},{1,3}}', [0, 2]),
    ('replica_groups=[2,4]<=[8]', [0, 1, 2, 3]),
    ('replica_groups=[4,2]<=[2,4]T(1,0)', [0, 4]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [0, 4]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     [0, 4]),
])
def test_replica_group_formats(attrs, group):
  assert hlo_text.first_group(attrs, 8) == group


def test_collective_over_two_torus_dimensions_uses_twice_the_links():
  ins = hlo_text.parse_instr(
      '  %ag = bf16[4096]{0} all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}')
  line = [(0, 0), (1, 0), (2, 0), (3, 0)]
  square = [(0, 0), (1, 0), (0, 1), (1, 1)]
  one = step_model.collective_seconds(ins, 2048, CHIP, 4, line)
  two = step_model.collective_seconds(ins, 2048, CHIP, 4, square)
  assert one == pytest.approx(8192 * 3 / 4 / (2 * 1e9))
  assert two == pytest.approx(one / 2)
