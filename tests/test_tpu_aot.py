"""The decomposed einsum as the real TPU compiler schedules it (AOT, on CPU).

Needs the ``tpu`` extra (libtpu). Compiles in a subprocess with XLA's own
windowed einsum turned off, so every collective-permute in the program is ours.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from launch import aot
from parallelism import hardware, hlo_text, pair_sums, step_model
from parallelism import kernels as kernels_lib
from tests.conftest import ROOT
from trainer.hints import install_hint

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec('libtpu') is None,
    reason=f"libtpu is not installed ({install_hint('tpu')}); TPU AOT compile skipped")


def _compile(mode: str, kind: str, chip: str = 'tpu_v4', flags: str = '', layers: int = 0,
             additions: str = 'apart', pairs: str = 'joined', ring_order: str = '',
             unroll: int = 1) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
  env['LIBTPU_INIT_ARGS'] = ' '.join(
      filter(None, [flags, '--xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000']))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', 'tpu_aot_probe.py'),
                         mode, kind, chip, str(layers), additions, pairs, ring_order,
                         str(unroll)], env=env,
                        capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  _compile.planned_kernels = json.loads(proc.stderr.split('planned kernels: ')[1].splitlines()[0])
  return proc.stdout


def _overlapped_pairs(hlo: str) -> tuple[int, int]:
  """(our async permute pairs, of which with einsum work scheduled inside)."""
  lines = hlo.splitlines()
  pairs = overlapped = 0
  for i, line in enumerate(lines):
    m = re.search(r'(%[\w.\-]+) = .*collective-permute-start\(', line)
    if not m or 'collective_einsum' not in line:
      continue
    pairs += 1
    for later in lines[i + 1:]:
      if re.search(r'collective-permute-done\(' + re.escape(m.group(1)) + r'\b', later):
        break
      if re.search(r'\b(convolution|dot)\(|fusion\(.*kind=kOutput|calls=%?[\w.\-]*(convolution|dot)', later):
        overlapped += 1
        break
  return pairs, overlapped


@pytest.mark.parametrize('kind', ['ag', 'rs'])
def test_tpu_schedule_overlaps_our_permutes_with_einsums(kind):
  hlo = _compile('unidirectional', kind)
  pairs, overlapped = _overlapped_pairs(hlo)
  assert pairs >= 1, 'no collective-permute-start from collective_einsum in the TPU program'
  assert overlapped >= 1, f'{pairs} permute pairs but none has einsum work scheduled inside'
  plain = _compile('none', kind)
  assert _overlapped_pairs(plain)[0] == 0


@pytest.mark.parametrize('chip', sorted(n for n, p in hardware.PROFILES.items() if p.tpu))
def test_each_tpu_chip_compiles_with_its_default_flags(chip):
  # An unknown or refused flag aborts libtpu: every chip's default set must be accepted.
  flags = hardware.compiler_flags(hardware.get_profile(chip))
  hlo = _compile('unidirectional', 'ag', chip, flags)
  assert 'collective-permute-start' in hlo


def test_an_all_gather_ring_allocates_its_output_inside_the_layer_loop():
  # lax.empty depends on nothing: JAX hoisted it out of a differentiated layer scan, and the
  # compiler then copied that one buffer into every iteration (ring.fresh_buffer).
  module = hlo_text.parse(_compile('unidirectional', 'ag', layers=4))
  where = [comp for comp, instrs in module.computations.items() for i in instrs
           if 'AllocateBuffer' in i.attrs and 'collective_einsum' in i.op_name
           and i.op_name.endswith(('/empty', '/ring_buffer'))]
  assert where, 'no allocation of a ring output in the program'
  assert module.entry not in where, f'ring output allocated outside the layer loop: {where}'


@pytest.mark.parametrize('additions', ['apart', 'fused'])
def test_fused_additions_are_no_pass_of_their_own_in_the_ring_loop(additions):
  # parallelism.ring_additions: apart, each step's addition of the arriving accumulator is a
  # loop fusion of its own in the ring's loop; fused, the TPU compiler fuses it into the
  # step's einsum (an output fusion), and the accumulators travel in halves.
  module = hlo_text.parse(_compile('unidirectional', 'rs', additions=additions))
  called = {m.group(1) for instrs in module.computations.values() for i in instrs
            if i.opcode == 'fusion' for m in [re.search(r'calls=%?([\w.\-]+)', i.attrs)] if m}
  loop = [i for name, instrs in module.computations.items() if name not in called
          for i in instrs if '/while/body/' in i.op_name and 'collective_einsum' in i.op_name]
  passes = [i.name for i in loop if i.opcode == 'fusion' and 'partial_sums' in i.op_name]
  sent = {hlo_text.shape_bytes(hlo_text.tuple_element(i.shape, 0)) for i in loop
          if i.opcode == 'collective-permute-start'}
  block = 1024 * 4096 * 2  # the probe's [t / 8, d] output block, in bf16
  if additions == 'apart':
    assert passes and sent == {block}, (passes, sent)
  else:
    assert not passes and sent == {block // 2}, (passes, sent)


@pytest.mark.parametrize('pairs', ['joined', 'apart'])
def test_apart_pairs_join_and_split_no_blocks_in_the_ring_loop(pairs):
  # parallelism.gather_pairs on a bidirectional all-gather ring (8 devices, in a loop):
  # joined, each round's two blocks are joined for one einsum and its product split apart
  # (copies in the loop); apart, an einsum a block, each written where it goes.
  module = hlo_text.parse(_compile('bidirectional', 'ag', pairs=pairs))
  loop = [i for instrs in module.computations.values() for i in instrs
          if '/while/body/' in i.op_name and 'collective_einsum' in i.op_name]
  copies = [i.name for i in loop if i.op_name.endswith(('/concatenate', '/split'))]
  einsums = [i.name for i in loop if i.opcode == 'convolution']
  if pairs == 'joined':
    assert copies and len(einsums) == 1, (copies, einsums)
  else:
    assert not copies and len(einsums) == 2, (copies, einsums)


@pytest.mark.parametrize('ring_order', ['', 'out'])
def test_a_ring_in_ring_order_writes_its_result_once(ring_order):
  # A one-way all-gather ring with no loop (8 devices, unroll 8) joins its parts in the
  # order they arrive; put back in order, the join is rolled (written twice over, then
  # sliced: the 64B's gate/up ring, docs/paper_scale.md); in ring order it is not.
  module = hlo_text.parse(_compile('unidirectional', 'ag', ring_order=ring_order, unroll=8))
  rolled = [i.name for instrs in module.computations.values() for i in instrs
            if '_roll_dynamic' in i.op_name]
  assert bool(rolled) == (not ring_order), rolled


@pytest.mark.parametrize('additions', ['fused', 'kernel'])
def test_a_weight_gradient_ring_runs_each_round_as_one_kernel(additions):
  # An FSDP layer's weight gradient, a bidirectional ring over fsdp (8 chips, in a loop).
  # The schedule's additions 'fused' leave its additions a pass of their own after each round's
  # einsum; 'kernel' runs each round's half as one Pallas kernel (parallelism/pair_sums.py)
  # that adds both directions' accumulators as it writes, and the step model costs each
  # kernel as it declares, its FLOPs and bytes those of the shapes it runs, on its grid.
  hlo = _compile('bidirectional', 'wg', layers=1, additions=additions)
  module = hlo_text.parse(hlo)
  # launch.aot names the rings whose rounds run as kernels, with their modeled time
  kernel_rings = aot.by_ring(step_model.analyze(hlo, step_model.Chip.from_profile(
      'tpu_v4')).kernels_by_op)
  assert [k.split(': ', 1)[1] for k in kernel_rings] == (
      ['td,tf->df (reducescatter, bidirectional)'] if additions == 'kernel' else []), kernel_rings
  # ... the rings the plan says run it (report.kernel_rings, launch.aot's planned_kernels)
  assert _compile.planned_kernels == [k.split(': ', 1)[1] for k in kernel_rings]
  ring_ops = [(i, c) for c, instrs in module.computations.items() for i in instrs
              if 'reducescatter/bidirectional' in i.op_name]
  kernels = [(i, c) for i, c in ring_ops if i.opcode == 'custom-call']
  passes = [i.name for i, _ in ring_ops if i.opcode == 'fusion' and 'partial_sums' in i.op_name
            and '/while/body/' in i.op_name]
  if additions == 'fused':
    assert passes and not kernels, (passes, kernels)
    return
  assert kernels and not passes, (passes, [i.name for i, _ in kernels])
  shapes = {i.name: i.shape for instrs in module.computations.values() for i in instrs}
  for ins, _ in kernels:
    assert pair_sums.NAME in ins.name and '/while/body/' in ins.op_name
    xt, acc = (hlo_text.shape_dims(shapes[ins.operands[k]]) for k in (1, 4))
    assert xt == [1, 4096, 1024] and acc == [1, 512, 2048], (xt, acc)  # [B, D, T], [P', rows, Q']
    # a 512-row block's buffers fit VMEM with 512 columns (tests/test_pair_sums.py)
    assert step_model.kernel_cost(ins) == pair_sums.cost(xt, acc, 2, 2, (1, 512))
    # its grid, read from the compiled kernel: 4 blocks of columns, parallel, so both of a
    # v4 chip's TensorCores share it; then the batch and 2 token tiles, summed
    grid = hlo_text.kernel_grid(ins)
    assert grid.bounds == (1, 4, 1, 2) and grid.parallel == (True, True, False, False), grid
    assert kernels_lib.cores_used(grid, 2) == 2 and grid.matmuls == ((512, 512, 512),) * 2
