"""The analytical step model on hand-built schedules with known answers."""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import pytest

from parallelism import hardware, hlo_text, kernels, pricing, step_model
from parallelism import ring as ring_lib

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
  %mm = bf16[64,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul, metadata={op_name="collective_einsum/ring/dot_general"}
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


def test_exposed_by_names_what_the_chip_waited_for():
  r = step_model.analyze(HAND_BUILT, CHIP)
  matmul = 2 * 64 * 256 * 128 / 1e12
  permute = 64 * 128 * 2 / 1e9
  all_gather = 256 * 128 * 2 * 3 / 4 / (2 * 1e9)
  assert r.exposed_by == {
      'collective-permute (async) @ collective_einsum/ring': pytest.approx(3 * (permute - matmul)),
      'all-gather (sync) @ ': pytest.approx(all_gather)}
  assert sum(r.exposed_by.values()) == pytest.approx(r.exposed_comm_seconds)


def test_compute_terms_split_the_compute():
  r = step_model.analyze(HAND_BUILT, CHIP)
  matmul = 2 * 64 * 256 * 128 / 1e12
  other = 3 * (4 + 4 + 4) / 1e11 + 4 * (4 + 4 + 1) / 1e11  # the loop counter and condition
  assert r.compute_terms == {'ring: matmul at MXU rate': pytest.approx(3 * matmul),
                             'ring: matmul HBM-bound excess': 0,
                             'plain: non-matmul': pytest.approx(other)}
  # With slow HBM the matmul is memory-bound: the excess is what its bytes add.
  slow_hbm = step_model.Chip('slow_hbm', peak_flops=1e12, hbm_bandwidth=1e10,
                             link_bandwidth=1e9, ring_links=1, step_latency=0.0)
  r = step_model.analyze(HAND_BUILT, slow_hbm)
  moved = (64 * 128 + 128 * 256 + 64 * 256) * 2 / 1e10
  assert r.compute_terms['ring: matmul HBM-bound excess'] == pytest.approx(3 * (moved - matmul))
  assert sum(r.compute_terms.values()) == pytest.approx(r.compute_seconds)


def test_a_rings_additions_of_partial_sums_are_a_term_of_their_own():
  ring = 'jit(f)/collective_einsum/reducescatter/unidirectional/ab,bc->ac/shard_map'
  adds = f'{ring}/{ring_lib.ADDITIONS_SCOPE}/convert_element_type'
  assert step_model.compute_terms(adds, 0.0, 2.0) == [('ring: partial-sum additions', 2.0)]
  assert step_model.compute_terms(f'{ring}/dynamic_slice', 0.0, 2.0) == [
      ('ring: non-matmul', 2.0)]
  # an addition outside a ring is plain work; one fused into a matmul is the matmul's
  assert step_model.compute_terms(f'jit(f)/{ring_lib.ADDITIONS_SCOPE}/add', 0.0, 2.0) == [
      ('plain: non-matmul', 2.0)]
  assert step_model.compute_terms(adds, 1.5, 2.0) == [('ring: matmul at MXU rate', 1.5),
                                                      ('ring: matmul HBM-bound excess', 0.5)]


def test_non_matmul_work_by_op_name():
  r = step_model.analyze(HAND_BUILT, CHIP)
  add, compare = (4 + 4 + 4) / 1e11, (4 + 4 + 1) / 1e11  # the loop counter and condition
  # the compiler's own instructions (no op_name) by opcode and shape
  assert r.non_matmul_by_op == {"the compiler's add s32[]": pytest.approx(3 * add),
                                "the compiler's compare pred[]": pytest.approx(4 * compare)}
  assert sum(r.non_matmul_by_op.values()) == pytest.approx(r.compute_terms['plain: non-matmul'])
  # with the layout that tells two copies of one array apart, not the tiling
  copy = hlo_text.Instr('copy.1', 'bf16[2,2048,20480]{1,2,0:T(8,128)(2,1)S(3)}', 'copy',
                        ['x'], '', '')
  assert step_model.unnamed_key(copy) == "the compiler's copy bf16[2,2048,20480]{1,2,0}"


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
      '%n = s32[] constant(3)', '%n = s32[] constant(7)')
  assert text.count('constant(2)') > HAND_BUILT.count('constant(2)') and 'constant(7)' in text
  r = step_model.analyze(text, CHIP)  # 0, 2, 4, 6: four trips (one step at a time: seven)
  assert r.pairs[0]['executions'] == 4 and r.flops == 4 * 2 * 64 * 256 * 128


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


# Two permutes in flight over one matmul: the same direction (RIGHT twice), or opposite.
TWO_PERMUTES = """HloModule two, is_scheduled=true, num_partitions=4

%fused_matmul (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[64,128], w: bf16[128,256]) -> (bf16[64,128], bf16[64,128], bf16[64,256]) {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %a-start = (bf16[64,128]{1,0}, bf16[64,128]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %b-start = (bf16[64,128]{1,0}, bf16[64,128]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs=SECOND
  %mm = bf16[64,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul
  %a-done = bf16[64,128]{1,0} collective-permute-done(%a-start)
  %b-done = bf16[64,128]{1,0} collective-permute-done(%b-start)
  ROOT %out = (bf16[64,128]{1,0}, bf16[64,128]{1,0}, bf16[64,256]{1,0}) tuple(%a-done, %b-done, %mm)
}
"""
RIGHT, LEFT = '{{0,1},{1,2},{2,3},{3,0}}', '{{1,0},{2,1},{3,2},{0,3}}'
LINE = [(0, 0), (1, 0), (2, 0), (3, 0)]  # four chips on a ring along dimension 0


def test_links_a_transfer_occupies():
  permute = lambda pairs: hlo_text.parse_instr(
      f'  %p = bf16[8]{{0}} collective-permute(%x), source_target_pairs={pairs}')
  assert step_model.links(permute(RIGHT), 4, LINE) == {(0, 1)}
  assert step_model.links(permute(LEFT), 4, LINE) == {(0, -1)}
  # A ring around a 2 x 2 square: two of its four hops along each dimension, so both.
  square = [(0, 0), (1, 0), (1, 1), (0, 1)]
  assert step_model.links(permute(RIGHT), 4, square) == {(0, 1), (1, 1)}
  # Around a 4 x 2 torus in rows: six of eight hops along dimension 0, the corners along 1.
  rows = [(x, y) for y in range(2) for x in range(4)]
  ring8 = '{' + ','.join(f'{{{i},{(i + 1) % 8}}}' for i in range(8)) + '}'
  assert step_model.links(permute(ring8), 8, rows) == {(0, 1)}
  gather = hlo_text.parse_instr(
      '  %ag = bf16[32]{0} all-gather(%x), replica_groups={{0,1,2,3}}, dimensions={0}')
  square = [(0, 0), (1, 0), (0, 1), (1, 1)]
  assert step_model.links(gather, 4, square) == {(0, 1), (0, -1), (1, 1), (1, -1)}
  # Without coordinates only the same pairs (or group) share.
  assert step_model.links(permute(RIGHT), 4) != step_model.links(permute(LEFT), 4)
  other = hlo_text.parse_instr(  # another permute (type, name, async) on the same pairs
      f'  %q = f32[64]{{0}} collective-permute-start(%y), source_target_pairs={RIGHT}')
  assert step_model.links(other, 4) == step_model.links(permute(RIGHT), 4)


@pytest.mark.parametrize('second,turns', [(RIGHT, 2), (LEFT, 1)])
def test_transfers_sharing_a_link_take_turns(second, turns):
  r = step_model.analyze(TWO_PERMUTES.replace('SECOND', second), CHIP, LINE)
  permute = 64 * 128 * 2 / 1e9
  matmul = 2 * 64 * 256 * 128 / 1e12
  assert r.step_seconds == pytest.approx(turns * permute)
  first, then = r.pairs
  assert first['queued_us'] == 0 and first['exposed_us'] == pytest.approx(
      (permute - matmul) * 1e6)
  assert then['queued_us'] == pytest.approx((turns - 1) * permute * 1e6)
  assert then['exposed_us'] == pytest.approx((turns - 1) * permute * 1e6)


def test_a_synchronous_collective_waits_for_its_links():
  text = HAND_BUILT.replace(
      '  ROOT %ag = bf16[256,128]{1,0} all-gather(%y)',
      '  %cp2-start = (bf16[64,128]{1,0}, bf16[64,128]{1,0}, u32[], u32[]) '
      'collective-permute-start(%y), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n'
      '  %ag = bf16[256,128]{1,0} all-gather(%y)').replace(
      'dimensions={0}\n}', 'dimensions={0}\n  ROOT %cp2-done = bf16[64,128]{1,0} '
      'collective-permute-done(%cp2-start)\n}')
  alone = step_model.analyze(HAND_BUILT, CHIP, LINE)
  r = step_model.analyze(text, CHIP, LINE)
  permute = 64 * 128 * 2 / 1e9
  assert r.warnings == []
  assert r.step_seconds == pytest.approx(alone.step_seconds + permute)
  assert r.exposed_comm_seconds == pytest.approx(alone.exposed_comm_seconds + permute)


# ---- the asynchronous forms the TPU compiler emits ---------------------------------

DATA = os.path.join(os.path.dirname(__file__), 'data')


def test_async_collective_fusions_count_their_compute_and_hide_their_transfer():
  # Compiled by libtpu for v5p:2x2x2 with MaxText's flags (hardware.MAXTEXT_TPU_FLAGS):
  # the grad of a 2-layer MLP, FSDP x tensor. An all-gather runs as an
  # async-collective-start fusion, two compute fusions that carry it along (each
  # with a convolution and the collective inside) and an async-collective-done.
  with open(os.path.join(DATA, 'async_collective_fusion_v5p.hlo'), encoding='utf-8') as f:
    text = f.read()
  chip = step_model.Chip.from_profile('tpu_v5p', calibrated=False)
  r = step_model.analyze(text, chip)
  module = hlo_text.parse(text)
  convs = sum(step_model.conv_flops(i, {x.name: x.shape for x in ins})
              for ins in module.computations.values() for i in ins
              if i.opcode == 'convolution')
  assert r.warnings == []
  assert r.flops == convs  # the two convolutions fused with the collective count too
  assert 'all-gather (fused)' not in r.collectives
  assert r.collectives['all-gather (async)']['count'] == 1
  [pair] = [p for p in r.pairs if p['kind'] == 'all-gather']
  assert (pair['start'], pair['done']) == ('async-collective-start', 'async-collective-done')
  assert pair['einsums_between'] == ['fusion.15', 'fusion.20']
  assert pair['compute_between_us'] > pair['transfer_us'] and pair['exposed_us'] == 0


# An all-gather started before a loop whose body carries it (a continuation fusion
# with a dot and the collective of the same channel), done after the loop; then the
# same collective as an async-start/async-done wrapper around a matmul.
NESTED = """HloModule nested, is_scheduled=true, num_partitions=4

%ag_start (p0: bf16[64,128]) -> (bf16[64,128], bf16[256,128]) {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %ag = bf16[256,128]{1,0} all-gather(%p0), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %cc = (bf16[64,128]{1,0}, bf16[256,128]{1,0}) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}

%ag_carry (c0: bf16[64,128], c1: bf16[128,256], c2: bf16[64,128]) -> (bf16[64,256], bf16[256,128]) {
  %c0 = bf16[64,128]{1,0} parameter(0)
  %c1 = bf16[128,256]{1,0} parameter(1)
  %c2 = bf16[64,128]{1,0} parameter(2)
  %d = bf16[64,256]{1,0} dot(%c0, %c1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag2 = bf16[256,128]{1,0} all-gather(%c2), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (bf16[64,256]{1,0}, bf16[256,128]{1,0}) tuple(%d, %ag2)
}

%ag_done (q0: bf16[64,128]) -> bf16[256,128] {
  %q0 = bf16[64,128]{1,0} parameter(0)
  %ag3 = bf16[256,128]{1,0} all-gather(%q0), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %cd = bf16[256,128]{1,0} custom-call(%q0, %ag3), custom_call_target="AsyncCollectiveDone"
}

%body (loop: (s32[], bf16[64,128], bf16[128,256])) -> (s32[], bf16[64,128], bf16[128,256]) {
  %loop = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %x = bf16[64,128]{1,0} get-tuple-element(%loop), index=1
  %w = bf16[128,256]{1,0} get-tuple-element(%loop), index=2
  %carry = (bf16[64,256]{1,0}, bf16[256,128]{1,0}) fusion(%x, %w, %x), kind=kOutput, calls=%ag_carry
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%next, %x, %w)
}

%cond (loop: (s32[], bf16[64,128], bf16[128,256])) -> pred[] {
  %loop = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%wrapped (a0: bf16[64,128]) -> bf16[256,128] {
  %a0 = bf16[64,128]{1,0} parameter(0)
  ROOT %ag4 = bf16[256,128]{1,0} all-gather(%a0), channel_id=8, replica_groups={{0,1,2,3}}, dimensions={0}
}

%fused_matmul (m0: bf16[64,128], m1: bf16[128,256]) -> bf16[64,256] {
  %m0 = bf16[64,128]{1,0} parameter(0)
  %m1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%m0, %m1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[64,128], w: bf16[128,256]) -> bf16[256,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %start = (bf16[64,128]{1,0}, bf16[256,128]{1,0}) fusion(%x), kind=kCustom, calls=%ag_start
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%zero, %x, %w)
  %ring = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) while(%init), condition=%cond, body=%body
  %s0 = bf16[64,128]{1,0} get-tuple-element(%start), index=0
  %done = bf16[256,128]{1,0} fusion(%s0), kind=kCustom, calls=%ag_done
  %ags = ((bf16[64,128]{1,0}), bf16[256,128]{1,0}, u32[]) async-start(%x), calls=%wrapped
  %mm = bf16[64,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul, metadata={op_name="collective_einsum/ring/dot_general"}
  ROOT %agd = bf16[256,128]{1,0} async-done(%ags)
}
"""


def test_async_collective_carried_through_a_loop_and_async_wrappers():
  r = step_model.analyze(NESTED, CHIP)
  matmul = 2 * 64 * 256 * 128
  gather = 256 * 128 * 2 * 3 / 4 / (2 * 1e9)
  assert r.warnings == []
  assert r.flops == 5 * matmul  # four carried in the loop, one between async-start and -done
  assert r.collectives == {'all-gather (async)': {'count': 2, 'seconds': pytest.approx(2 * gather)}}
  by_start = {p['start']: p for p in r.pairs}
  assert by_start['start']['done'] == 'done' and by_start['start']['einsums_between'] == ['ring']
  assert by_start['ags']['done'] == 'agd' and by_start['ags']['einsums_between'] == ['mm']
  # The loop's four carried einsums (and its counter's scalar ops) hide one gather, one
  # einsum the other.
  mm = matmul / CHIP.matmul_rate
  assert by_start['start']['compute_between_us'] == pytest.approx(4 * mm * 1e6, rel=1e-3)
  assert by_start['ags']['compute_between_us'] == pytest.approx(mm * 1e6)
  assert r.exposed_comm_seconds == pytest.approx(
      max(0, gather - 4 * mm) + max(0, gather - mm), rel=1e-3)


def test_the_fitted_constants_apply_unless_told_not_to(monkeypatch):
  monkeypatch.setattr(pricing, 'MATMUL_EFFICIENCY', 0.5)
  monkeypatch.setattr(pricing, 'LINK_EFFICIENCY', 0.25)
  profile = hardware.PROFILES['tpu_v4']
  fitted = step_model.Chip.from_profile('tpu_v4')
  assert fitted.matmul_rate == 0.5 * profile.peak_flops
  assert fitted.link_rate == 0.25 * profile.link_bandwidth
  sheet = step_model.Chip.from_profile('tpu_v4', calibrated=False)
  assert (sheet.matmul_rate, sheet.link_rate) == (profile.peak_flops, profile.link_bandwidth)


def test_one_table_of_hardware_facts():
  for name, profile in hardware.PROFILES.items():
    if profile.tpu:
      assert profile.hbm_bandwidth > 0 and profile.usable_hbm_bytes > 0
      assert hardware.TPU_PREFIXES[profile.tpu.prefix] is profile
      chip = step_model.Chip.from_profile(name)
      assert chip.hbm_bandwidth == profile.hbm_bandwidth
      assert chip.matmul_rate == profile.peak_flops * pricing.MATMUL_EFFICIENCY
  assert hardware.compiler_flags(hardware.PROFILES['tpu_v5p']) == ' '.join(
      hardware.MAXTEXT_TPU_FLAGS)
  assert hardware.compiler_flags(hardware.PROFILES['tpu_v5p'], 'none') == ''
  extra = '--xla_tpu_enable_ici_ag_pipelining=true'  # a config adds to its chip's row
  assert hardware.compiler_flags(hardware.PROFILES['tpu_v5p'], f'default {extra}') == ' '.join(
      hardware.MAXTEXT_TPU_FLAGS + (extra,))
  assert hardware.compiler_flags(hardware.PROFILES['tpu_v5p'], extra) == extra


SPLASH = r"""HloModule splash, is_scheduled=true, num_partitions=1

ENTRY %main (p0: bf16[2,4,1024,128], p1: bf16[2,1,1024,128]) -> bf16[2,4,1024,128] {
  %p0 = bf16[2,4,1024,128]{3,2,1,0} parameter(0)
  %p1 = bf16[2,1,1024,128]{3,2,1,0} parameter(1)
  %mask = s8[1,2,2]{2,1,0} constant({...})
  %splash_mha_fwd_segmented_residuals.3 = (bf16[2,4,1024,128]{3,2,1,0}) custom-call(%mask, %p0, %p1, %p1), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\"block_q\": 512, \"block_kv\": 512, \"block_q_dq\": 256}"
}}, metadata={op_name="jit(train_step)/splash_mha_fwd/pallas_call"}, backend_config={"custom_call_config":{"body":"FWD"}}
  %splash_mha_dkv_no_residuals.1 = (bf16[2,1,1024,128]{3,2,1,0}) custom-call(%mask, %p0, %p1, %p1), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\"block_q_dkv\": 256, \"block_kv_dkv\": 512}"
}}, metadata={op_name="jit(train_step)/splash_mha_dkv/pallas_call"}, backend_config={"custom_call_config":{"body":"DKV"}}
  ROOT %out = bf16[2,4,1024,128]{3,2,1,0} get-tuple-element(%splash_mha_fwd_segmented_residuals.3), index=0
}
"""


@functools.cache
def mosaic_body(grid: tuple, semantics: tuple, block=(128, 128, 128)) -> str:
  """The Mosaic body (base64) of a Pallas kernel of ``grid`` with these dimension
  semantics and one block matmul of ``block`` (m, k, n), lowered for TPU on this CPU."""
  m, k, n = block
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
  first = lambda *_: (0, 0)
  call = pl.pallas_call(kernel, grid=grid, in_specs=[pl.BlockSpec((m, k), first),
                                                     pl.BlockSpec((k, n), first)],
                        out_specs=pl.BlockSpec((m, n), first),
                        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
                        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))
  text = jax.jit(call).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct(
      (k, n), jnp.bfloat16)).lower(lowering_platforms=('tpu',)).as_text()
  return re.search(r'body\\22: \\22([A-Za-z0-9+/=]+)', text).group(1)


# the splash kernels' grids: heads (parallel), query blocks, key blocks; dkv all arbitrary
SPLASH = SPLASH.replace('FWD', mosaic_body((4, 2, 2), ('parallel', 'arbitrary', 'arbitrary'),
                                           (512, 128, 512)))
SPLASH = SPLASH.replace('DKV', mosaic_body((1, 2, 2), ('arbitrary',) * 3, (512, 128, 512)))


def test_splash_kernels_count_their_causal_blocks():
  """A kernel spanning lines (its JSON attributes) parses whole; its FLOPs come from q, k, blocks."""
  r = step_model.analyze(SPLASH, CHIP)
  per_pair = 2 * 8 * 128  # 2 FLOPs x batch 2 x 4 heads x head_dim 128, per query-key pair
  fwd = 2 * per_pair * 3 * 512 * 512             # q.k and p.v over 3 of 4 blocks of 512
  dkv = 4 * per_pair * (1 + 1 + 2 + 2) * 256 * 512  # query blocks of 256 see 1, 1, 2, 2 key blocks
  assert r.flops == pytest.approx(fwd + dkv)


def test_splash_kernels_with_a_batch_of_one():
  """The compiler drops a local batch of one: q and k come as [heads, length, head_dim]."""
  unbatched = SPLASH.replace('[2,4,1024,128]', '[4,1024,128]').replace('[2,1,1024,128]',
                                                                       '[1,1024,128]')
  unbatched = unbatched.replace('{3,2,1,0}', '{2,1,0}')
  assert step_model.analyze(unbatched, CHIP).flops == pytest.approx(
      step_model.analyze(SPLASH, CHIP).flops / 2)


def test_a_fusion_reads_only_the_block_a_nested_fusion_slices():
  # A ring step's einsum: the compiler slices the block out of the whole operand inside a
  # nested loop fusion; the step reads the block (64 x 32 bf16), not the operand.
  text = """HloModule nested, is_scheduled=true, num_partitions=1

%slice_block (a: bf16[64,128], i: s32[]) -> bf16[64,32] {
  %a = bf16[64,128]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %block = bf16[64,32]{1,0} dynamic-slice(%a, %zero, %i), dynamic_slice_sizes={64,32}
}

%step (p0: bf16[64,128], p1: s32[], p2: bf16[32,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[32,256]{1,0} parameter(2)
  %blk = bf16[64,32]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%slice_block
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%blk, %p2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[64,128], i: s32[], w: bf16[32,256]) -> bf16[64,256] {
  %x = bf16[64,128]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = bf16[32,256]{1,0} parameter(2)
  ROOT %y = bf16[64,256]{1,0} fusion(%x, %i, %w), kind=kOutput, calls=%step
}
"""
  module = hlo_text.parse(text)
  costs = step_model._Costs(module)  # pylint: disable=protected-access
  [y] = [i for i in module.computations[module.entry] if i.name == 'y']
  block, w, out = 64 * 32 * 2, 32 * 256 * 2, 64 * 256 * 2
  assert costs.instr_bytes(y, module.entry) == block + 4 + w + out
  # Read whole where a use takes all of it (here the block and an add of the operand).
  whole = text.replace('ROOT %dot.1', '%sum = bf16[64,128]{1,0} add(%p0, %p0)\n  ROOT %dot.1')
  module = hlo_text.parse(whole)
  [y] = [i for i in module.computations[module.entry] if i.name == 'y']
  assert step_model._Costs(module).instr_bytes(y, module.entry) == 64 * 128 * 2 + 4 + w + out


def test_an_allocated_buffer_costs_no_traffic():
  # lax.empty on TPU (an all-gather ring's output, before its blocks are written in): a
  # custom-call AllocateBuffer, which writes nothing; a copy of it reads and writes.
  text = """HloModule empty, is_scheduled=true, num_partitions=1

ENTRY %main () -> bf16[64,128] {
  %buf = bf16[64,128]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %c = bf16[64,128]{1,0} copy(%buf)
}
"""
  module = hlo_text.parse(text)
  costs = step_model._Costs(module)  # pylint: disable=protected-access
  buf, copy = module.computations[module.entry]
  assert costs.instr_bytes(buf, module.entry) == 0
  assert costs.instr_bytes(copy, module.entry) == 2 * 64 * 128 * 2


# An HBM-to-HBM copy, a prefetch into memory space 3 and an async slice out of HBM into it,
# each waited for at once: the chip waits out the whole DMA of each.
COPIES = """HloModule copies, is_scheduled=true, num_partitions=1

ENTRY %main (x: bf16[1024,1024]) -> bf16[512,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %hbm-start = (bf16[1024,1024]{0,1}, bf16[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%x)
  %hbm = bf16[1024,1024]{0,1} copy-done(%hbm-start)
  %pre-start = (bf16[1024,1024]{1,0:T(8,128)(2,1)S(3)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%x)
  %pre = bf16[1024,1024]{1,0:T(8,128)(2,1)S(3)} copy-done(%pre-start)
  %half-start = ((bf16[1024,1024]{1,0}), bf16[512,1024]{1,0:S(3)}, s32[]{:S(2)}) slice-start(%x), slice={[0:512], [0:1024]}
  ROOT %half = bf16[512,1024]{1,0:S(3)} slice-done(%half-start)
}
"""


def test_an_async_copy_crosses_hbm_once_for_each_end_there():
  assert [hlo_text.memory_space('(bf16[4]{0:T(8)S(3)}, bf16[4]{0}, u32[]{:S(2)})', k)
          for k in range(3)] == [3, 0, 2]
  assert hlo_text.memory_space('bf16[4]', 0) == 0
  r = step_model.analyze(COPIES, CHIP)
  size = 1024 * 1024 * 2
  # within HBM: read and written there; into memory space 3: read there only
  assert r.exposed_dma_seconds == pytest.approx((2 * size + size + size / 2) / 1e11)
  assert r.step_seconds == pytest.approx(r.exposed_dma_seconds)


def test_a_kernel_that_declares_its_cost_is_costed_as_it_declares():
  # A Pallas kernel's pl.CostEstimate, in its backend config (parallelism/pair_sums.py's
  # reads blocks of its operands: fewer bytes than they hold); the splash kernels declare none.
  body = mosaic_body((1, 2, 2), ('arbitrary',) * 3, (512, 128, 512))
  declared = SPLASH.replace(
      'splash_mha_dkv/pallas_call"}', 'ring_pair_sums/pallas_call"}').replace(
      f'"body":"{body}"}}', f'"body":"{body}","cost_estimate":{{"flops":"1000000000",'
      '"transcendentals":"0","bytes_accessed":"3000000","remote_bytes_transferred":"0"}}')
  dkv = [i for instrs in step_model.parse(declared).computations.values() for i in instrs
         if i.name.startswith('splash_mha_dkv')][0]
  assert step_model.kernel_cost(dkv) == (1e9, 3e6)
  splash = step_model.analyze(SPLASH, CHIP).flops
  fwd = 2 * (2 * 8 * 128) * 3 * 512 * 512  # as test_splash_kernels_count_their_causal_blocks
  assert step_model.analyze(declared, CHIP).flops == pytest.approx(fwd + 1e9)
  assert splash != pytest.approx(fwd + 1e9)
  assert all(step_model.kernel_cost(i) is None for instrs in
             step_model.parse(SPLASH).computations.values() for i in instrs)


def kernel_program(grid: tuple, semantics: tuple, flops: float, hbm_bytes: float,
                   block=(128, 128, 128), body: str = '') -> str:
  """A program of one Pallas kernel of ``grid`` that declares ``flops`` and ``hbm_bytes``."""
  body = body or mosaic_body(grid, semantics, block)
  return f"""HloModule kernel, is_scheduled=true, num_partitions=1

ENTRY %main (p0: bf16[128,128]) -> f32[128,128] {{
  %p0 = bf16[128,128]{{1,0}} parameter(0)
  ROOT %kernel.1 = f32[128,128]{{1,0}} custom-call(%p0), custom_call_target="tpu_custom_call", metadata={{op_name="jit(f)/kernel/pallas_call"}}, backend_config={{"custom_call_config":{{"body":"{body}","cost_estimate":{{"flops":"{flops:.0f}","transcendentals":"0","bytes_accessed":"{hbm_bytes:.0f}"}}}}}}
}}
"""


@pytest.mark.parametrize('chip', ['tpu_v4', 'tpu_v5p'])
def test_a_kernel_without_a_parallel_axis_of_two_runs_on_one_of_two_tensorcores(chip):
  # Mosaic splits a kernel over a v4 or v5p chip's two TensorCores only along a grid axis
  # marked parallel, of 2 or more: without one, its matmuls run at half the chip's peak.
  c = step_model.Chip.from_profile(chip)
  assert c.tensorcores == 2 and hardware.PROFILES[chip].tpu.chip_config_name == 'megacore'
  core = c.peak_flops / 2 * pricing.MATMUL_EFFICIENCY  # a kernel's matmuls as XLA's
  flops = 1e12
  for grid, semantics, cores in [((8,), ('arbitrary',), 1),
                                 ((1, 8), ('parallel', 'arbitrary'), 1),
                                 ((2, 4), ('arbitrary', 'arbitrary'), 1),
                                 ((2, 4), ('arbitrary', 'parallel'), 2),
                                 ((2, 4), ('parallel', 'arbitrary'), 2),
                                 ((3, 4), ('parallel', 'arbitrary'), 1.5)]:  # 2 of 3 on one
    r = step_model.analyze(kernel_program(grid, semantics, flops, 0), c)
    steps = 8 if grid != (3, 4) else 12
    assert r.compute_seconds == pytest.approx(
        flops / (cores * core) + steps / cores * c.kernel_step_seconds), (grid, semantics)
    assert r.kernels_by_op == {'jit(f)/kernel/pallas_call': pytest.approx(r.compute_seconds)}
  # a chip of one TensorCore runs any kernel at its whole peak
  v5e = step_model.Chip.from_profile('tpu_v5e')
  r = step_model.analyze(kernel_program((8,), ('arbitrary',), flops, 0), v5e)
  assert r.compute_seconds == pytest.approx(
      flops / v5e.matmul_rate + 8 * v5e.kernel_step_seconds)


def test_each_grid_step_of_a_kernel_costs_its_fixed_overhead():
  c = step_model.Chip.from_profile('tpu_v4')
  r = step_model.analyze(kernel_program((4, 16), ('arbitrary', 'arbitrary'), 0, 0), c)
  assert r.compute_seconds == pytest.approx(64 * hardware.PALLAS_STEP_SECONDS)
  assert r.compute_terms['plain: Pallas grid steps'] == pytest.approx(r.compute_seconds)
  # bytes beyond the matmuls' time: HBM-bound, the steps on top
  flops, hbm = 1e9, 1e9
  r = step_model.analyze(kernel_program((4, 16), ('parallel', 'arbitrary'), flops, hbm), c)
  assert r.compute_seconds == pytest.approx(hbm / c.hbm_bandwidth + 32 * c.kernel_step_seconds)
  assert sum(r.compute_terms.values()) == pytest.approx(r.compute_seconds)
  assert r.compute_terms['plain: matmul at MXU rate'] == pytest.approx(flops / c.matmul_rate)


def test_block_matmuls_narrower_than_the_mxu_waste_it():
  # A contracted or output width below the MXU's (128; 256 on v6e) pads to it.
  grid = lambda block: hlo_text.mosaic_grid(mosaic_body((2,), ('parallel',), block))
  assert grid((256, 64, 128)).matmuls == ((256, 64, 128),)
  assert kernels.tile_efficiency(grid((256, 128, 128)), 128) == 1.0
  assert kernels.tile_efficiency(grid((256, 64, 128)), 128) == 0.5
  assert kernels.tile_efficiency(grid((8, 512, 384)), 256) == 0.75
  assert kernels.tile_efficiency(grid((256, 128, 128)), 256) == 0.25
  v4, v6e = (step_model.Chip.from_profile(c) for c in ('tpu_v4', 'tpu_v6e'))
  assert v6e.mxu == 256 and v4.mxu == 128
  flops = 1e12
  seconds = lambda block, chip: step_model.analyze(
      kernel_program((2,), ('parallel',), flops, 0, block), chip).compute_seconds
  steps = 2 / 2 * v4.kernel_step_seconds
  assert seconds((256, 64, 128), v4) - steps == pytest.approx(2 * (seconds((256, 128, 128), v4)
                                                                   - steps))
  assert seconds((256, 128, 128), v6e) == pytest.approx(
      flops / (v6e.matmul_rate * 0.25) + 2 * v6e.kernel_step_seconds)


# The Pallas TPU matmul guide's measured table (v5e, bf16; configs/calibration/SOURCES.md
# 3A): (block m, k, n), matrix size, seconds a call, Python's dispatch included.
PALLAS_GUIDE = [((128, 128, 128), 1024, 0.00029766598949208854),
                ((128, 128, 128), 4096, 0.011771515250438824),
                ((128, 128, 128), 8192, 0.09183577066054567),
                ((512, 1024, 1024), 1024, 0.00012708659982308746),
                ((512, 1024, 1024), 4096, 0.00088908776990138),
                ((512, 1024, 1024), 8192, 0.006099433819763363)]


def test_the_kernel_step_reproduces_the_pallas_guides_table():
  # hardware.PALLAS_STEP_SECONDS, with the guide's dispatch and block matmuls' efficiency
  # (the fit's other two constants, 116 us and 0.975), times each of its rows within 2% on
  # a v5e
  v5e = dataclasses.replace(step_model.Chip.from_profile('tpu_v5e'), matmul_efficiency=0.975)
  for (bm, bk, bn), n, measured in PALLAS_GUIDE:
    grid = hlo_text.KernelGrid((n // bm, n // bn, n // bk), (True, True, False), ((bm, bk, bn),))
    seconds, _, _ = kernels.kernel_seconds(grid, 2 * n ** 3, 0, v5e)
    assert seconds + 116e-6 == pytest.approx(measured, rel=0.02), (bm, n)


def test_a_kernel_whose_grid_cannot_be_read_is_refused_by_name():
  program = kernel_program((2,), ('parallel',), 1e9, 0, body='AAAA')
  with pytest.raises(ValueError, match=r'Pallas kernel %kernel.1 \(jit\(f\)/kernel/pallas_call\)'
                     r': cannot read its grid'):
    step_model.analyze(program, CHIP)
  no_body = program.replace('"body":"AAAA",', '')
  with pytest.raises(ValueError, match='carries no Mosaic body'):
    step_model.analyze(no_body, CHIP)


def test_a_permutes_route_counts_the_busiest_link_and_the_longest_pair():
  line = [(x, 0, 0) for x in range(4)]  # a ring of 4 along one torus dimension
  assert step_model.route([(0, 1), (1, 2), (2, 3), (3, 0)], line) == (1, 1)
  # the other way round, the shorter way: still one hop a pair, on the -1 links
  assert step_model.route([(1, 0), (2, 1), (3, 2), (0, 3)], line) == (1, 1)
  # 0 -> 2 and 1 -> 3 both cross the link from 1 to 2
  assert step_model.route([(0, 2), (1, 3)], line) == (2, 2)
  # a ring over a 2 x 2 plane turns corners: one hop a pair; over 2 x 4 in snake order,
  # the pair back to the start crosses one dimension, two hops along the other
  square = [(x, y, 0) for y in range(2) for x in range(2)]
  assert step_model.route([(0, 1), (1, 3), (3, 2), (2, 0)], square) == (1, 1)
  assert step_model.route([(0, 1)], None) == (1, 1)
  wide = [(x, y, 0) for y in range(2) for x in range(4)]  # ids 0-3 at y=0, 4-7 at y=1
  assert step_model.route([(3, 4)], wide) == (1, 2)  # (3,0) -> (0,1): wraps x, then y
  # plain ints, for launch.aot's JSON
  assert all(type(x) is int for x in step_model.route([(3, 4)], [tuple(c) for c in wide]))
