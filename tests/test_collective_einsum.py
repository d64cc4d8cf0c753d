"""Decomposed collective einsums: values, gradients, HLO structure, cost model."""

import dataclasses
import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from parallelism import cost_model, einsum_plan, hlo_text, mesh as mesh_lib, pricing
from parallelism import ring as ring_lib
from parallelism.collective_einsum import collective_einsum, ring_order_fits, run_decision
from parallelism.decision import explain, local_elements, with_schedules
from parallelism.ring_specs import Static, gathered_dims_major, keeps_cotangent
from parallelism.einsum_plan import Equation

T, D = 'tensor', 'data'
# (equation, lhs spec, rhs spec, out spec, expected kind); T is decomposed.
PATTERNS = [
    ('btd,df->btf', P(D, T, None), P(None, T), P(D, None, T), 'allgather_free'),
    ('df,btd->btf', P(None, T), P(D, T, None), P(D, None, T), 'allgather_free'),
    ('btd,df->btf', P(D, None, T), P(None, T), P(D, None, T), 'allgather_contracting'),
    ('btf,fd->btd', P(D, None, T), P(T, None), P(D, T, None), 'reducescatter'),
    ('bf,fd->bd', P(None, T), P(T, None), P(None, T), 'reducescatter'),
    ('btd,dnh->btnh', P(D, T, None), P(None, T, None), P(D, None, T, None), 'allgather_free'),
    ('btnh,nhd->btd', P(D, None, T, None), P(T, None, None), P(D, T, None), 'reducescatter'),
]


@functools.cache
def _mesh(tensor: int, data: int = None):
  data = data or 8 // tensor
  return mesh_lib.make_mesh(dict(data=data, fsdp=8 // (tensor * data), tensor=tensor,
                                 expert=1, dcn_data=1, dcn_fsdp=1, dcn_tensor=1,
                                 dcn_expert=1))


def _shapes(eq, specs, mesh, base):
  """Letter sizes: ``base[letter]`` times the mesh sizes that shard the letter anywhere."""
  ins, out = eq.split('->')
  lhs, rhs = ins.split(',')
  factors = {}
  for letters, spec in zip((lhs, rhs, out), specs):
    for letter, axes in einsum_plan.letter_axes(letters, spec).items():
      for a in axes:
        factors.setdefault(letter, {})[a] = mesh.shape[a] * (2 if a == T else 1)
  size = lambda l: base[l] * int(np.prod(list(factors.get(l, {}).values()) or [1]))
  return tuple(size(l) for l in lhs), tuple(size(l) for l in rhs)


def _operands(pattern, mesh, base: int = 2):
  """Random (x, w) for ``pattern`` on ``mesh``: each letter ``base`` times its mesh sizes."""
  eq, ls, rs, os_ = pattern[:4]
  lhs_shape, rhs_shape = _shapes(eq, (ls, rs, os_), mesh, dict.fromkeys('btdfnh', base))
  return (jax.random.normal(jax.random.key(0), lhs_shape),
          jax.random.normal(jax.random.key(1), rhs_shape))


def _on_ring_of_8(pattern, mode: str):
  """(mesh, x, w, decision) for ``pattern`` decomposed over tensor = 8 in ``mode``."""
  eq, ls, rs, os_ = pattern[:4]
  mesh = _mesh(8, 1)
  x, w = _operands(pattern, mesh)
  return mesh, x, w, explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls,
                             rhs_spec=rs, out_spec=os_, mode=mode)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _run(eq, lhs_spec, rhs_spec, out_spec, mesh, lhs, rhs, mode, unroll=1):
  f = lambda x, w: collective_einsum(eq, x, w, mesh=mesh, lhs_spec=lhs_spec,
                                     rhs_spec=rhs_spec, out_spec=out_spec, mode=mode,
                                     prefer={'unroll': unroll})
  loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * weights(f(x, w).shape))
  return jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1)))


def _ran(d, x, w, *, mesh, lhs_spec, rhs_spec, out_spec, **prefer):
  """``run_decision`` of ``d`` with its rings' schedules chosen anew under ``prefer``."""
  d = with_schedules(d, x.shape, w.shape, mesh=mesh, lhs_spec=lhs_spec, rhs_spec=rhs_spec,
                     out_spec=out_spec, prefer=prefer)
  return run_decision(d, x, w, mesh=mesh, lhs_spec=lhs_spec, rhs_spec=rhs_spec,
                      out_spec=out_spec)


def weights(shape):
  return jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32)).reshape(shape)


def _assert_gradients_match_einsum(f, eq, x, w):
  """Both operands' gradients of ``f`` (``einsum(eq, x, w)`` decomposed) against the plain
  einsum's, under a fixed weighting of the output."""
  out_shape = jax.eval_shape(lambda a, b: jnp.einsum(eq, a, b), x, w).shape
  loss = lambda fn: lambda a, b: jnp.sum(fn(a, b) * weights(out_shape))
  got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
  want = jax.grad(loss(lambda a, b: jnp.einsum(eq, a, b)), argnums=(0, 1))(x, w)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@given(pattern=st.sampled_from(PATTERNS), tensor=st.sampled_from([1, 2, 4, 8]),
       dtype=st.sampled_from(['float32', 'bfloat16']),
       mode=st.sampled_from(['unidirectional', 'bidirectional']),
       unroll=st.sampled_from([1, 2]),
       base=st.fixed_dictionaries({l: st.integers(1, 3) for l in 'btdfnh'}))
def test_matches_plain_einsum(pattern, tensor, dtype, mode, unroll, base):
  eq, ls, rs, os_, _ = pattern
  mesh = _mesh(tensor)
  lhs_shape, rhs_shape = _shapes(eq, (ls, rs, os_), mesh, base)
  lhs = jax.random.normal(jax.random.key(0), lhs_shape).astype(dtype)
  rhs = jax.random.normal(jax.random.key(1), rhs_shape).astype(dtype)
  if tensor == 1:  # one device: no collective, nothing to decompose
    with pytest.raises(ValueError, match='no mesh axis needs a collective'):
      explain(eq, lhs_shape, rhs_shape, dtype, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode=mode)
    mode = 'auto'
  fwd, grad = _run(eq, ls, rs, os_, mesh, lhs, rhs, mode, unroll)
  ref32 = lambda x, w: jnp.einsum(eq, x.astype(jnp.float32), w.astype(jnp.float32))
  ref_grad = jax.grad(lambda x, w: jnp.sum(ref32(x, w) * weights(ref32(x, w).shape)),
                      argnums=(0, 1))(lhs, rhs)
  tol = 1e-5 if dtype == 'float32' else 2e-2
  out = fwd(lhs, rhs)
  assert out.dtype == jnp.dtype(dtype)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, os_), out.ndim)
  assert _rel(out, ref32(lhs, rhs)) < tol
  for got, want in zip(grad(lhs, rhs), ref_grad):
    assert _rel(got, want) < tol


# ----------------------------------------------------------------- HLO checks

def _executed(hlo: str, opcode: str = 'collective-permute') -> int:
  """Instructions with ``opcode`` (sync or async) a compiled module executes: loop
  bodies x trip counts."""
  module = hlo_text.parse(hlo)

  @functools.cache
  def count(comp):
    total = 0
    for ins in module.computations.get(comp, ()):
      total += ins.opcode.removesuffix('-start') == opcode
      total += sum(count(ins.attr(key)) for key in ('to_apply', 'calls') if ins.attr(key))
      if ins.opcode == 'while':
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
        assert trips, f'no known trip count on: {ins.name}'
        total += int(trips.group(1)) * count(ins.attr('body'))
    return total

  return count(module.entry)


def _collectives(hlo: str) -> dict[str, int]:
  ops = [i.opcode.removesuffix('-start')
         for instrs in hlo_text.parse(hlo).computations.values() for i in instrs]
  return {k: ops.count(k) for k in hlo_text.GROUP_COLLECTIVES}


@pytest.mark.parametrize('pattern', PATTERNS, ids=[p[0] + ':' + p[4] for p in PATTERNS])
def test_hlo_has_no_collective_over_the_decomposed_axis(pattern):
  eq, ls, rs, os_, kind = pattern
  mesh = _mesh(4, data=1)  # data=1: every collective left would be over tensor
  lhs_shape, rhs_shape = _shapes(eq, (ls, rs, os_), mesh, dict(b=2, t=2, d=2, f=2, n=2, h=2))
  lhs, rhs = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
  assert explain(eq, lhs_shape, rhs_shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                 out_spec=os_, mode='unidirectional').collective == kind
  n = mesh.shape[T]
  # An even bidirectional ring sends the opposite device's block as two halves, one each
  # way: n permutes of n - 1 blocks' bytes.
  for mode, steps in (('none', 0), ('unidirectional', n - 1), ('bidirectional', n)):
    fwd, _ = _run(eq, ls, rs, os_, mesh, lhs, rhs, mode)
    hlos = [fwd.lower(lhs, rhs).compile().as_text()]
    for argnum in (0, 1):  # each operand's gradient alone: one transposed einsum
      grad = jax.jit(jax.grad(lambda x, w: jnp.sum(fwd(x, w) * weights(fwd(x, w).shape)),
                              argnums=argnum))
      hlos.append(grad.lower(lhs, rhs).compile().as_text())
    for hlo in hlos:
      if mode == 'none':  # the plain einsum needs the collective: the check can fail
        assert sum(_collectives(hlo).values()) > 0
      else:
        assert sum(_collectives(hlo).values()) == 0, _collectives(hlo)
        assert _executed(hlo) == steps
    if mode != 'none':  # sequential steps: the longer of the two ring directions
      offsets = hlo_text.permute_offsets(hlo_text.parse(hlos[0]), mesh, T)
      rounds = max(offsets.count(1), offsets.count(n - 1))
      assert rounds == (n - 1 if mode == 'unidirectional' else -(-(n - 1) // 2)), offsets


def test_an_unrolled_unidirectional_all_gather_ring_joins_its_blocks_once():
  """With no loop (always on CPU), a unidirectional ring keeps each block's einsum apart
  and joins them at the end (on TPU, each block written into the buffer was first copied
  into the buffer's layout); a bidirectional one writes its pairs into a buffer."""
  eq, ls, rs, os_, _ = PATTERNS[0]
  mesh = _mesh(4, data=1)
  lhs_shape, rhs_shape = _shapes(eq, (ls, rs, os_), mesh, dict(b=2, t=2, d=2, f=2))
  lhs = jnp.arange(np.prod(lhs_shape), dtype=jnp.float32).reshape(lhs_shape)
  rhs = jnp.ones(rhs_shape)
  for mode, writes in (('unidirectional', False), ('bidirectional', True)):
    fwd, _ = _run(eq, ls, rs, os_, mesh, lhs, rhs, mode)
    assert ('dynamic_update_slice' in fwd.lower(lhs, rhs).as_text()) == writes, mode
    np.testing.assert_allclose(fwd(lhs, rhs), jnp.einsum(eq, lhs, rhs), rtol=1e-6)


def test_bidirectional_halves_the_sequential_steps():
  from parallelism import ring
  assert ring.ring_split(8, False) == (7, 0)
  assert ring.ring_split(8, True) == (4, 3)   # 4 sequential rounds instead of 7
  assert ring.ring_split(4, True) == (2, 1)
  assert ring.ring_split(2, True) == (1, 0)


# ------------------------------------------------------- errors and fallbacks

def test_explicit_mode_rejects_unsupported_specs():
  mesh = _mesh(4)
  # Contracting dim sharded on both operands with a replicated output: an all-reduce.
  with pytest.raises(ValueError, match=r'all-reduce over tensor.*\(lhs P\(None'):
    explain('bf,fd->bd', (8, 8), (8, 8), 'float32', mesh=mesh, lhs_spec=P(None, T),
            rhs_spec=P(T, None), out_spec=P(None, None), mode='unidirectional')
  with pytest.raises(ValueError, match='dimension b=6 is not divisible by tensor=4'):
    explain('bd,df->bf', (6, 8), (8, 8), 'float32', mesh=mesh, lhs_spec=P(T, None),
            rhs_spec=P(None, T), out_spec=P(None, T), mode='bidirectional')
  d = explain('bf,fd->bd', (8, 8), (8, 8), 'float32', mesh=mesh, lhs_spec=P(None, T),
              rhs_spec=P(T, None), out_spec=P(None, None), mode='auto')
  assert d.mode == 'none' and 'all-reduce' in d.reason
  # A gather whose output no device splits: every device would compute all of it.
  with pytest.raises(ValueError, match='the output is replicated over tensor'):
    explain('bd,df->bf', (8, 8), (8, 8), 'float32', mesh=mesh, lhs_spec=P(T, None),
            rhs_spec=P(None, None), out_spec=P(None, None), mode='unidirectional')


def test_inputs_are_resharded_and_explicit_meshes_refused(devices):
  mesh = _mesh(4)
  x = jax.random.normal(jax.random.key(0), (8, 8))  # on one device, not as lhs_spec says
  w = jax.random.normal(jax.random.key(1), (8, 8))
  out = collective_einsum('bd,df->bf', x, w, mesh=mesh, lhs_spec=P(T, None),
                          rhs_spec=P(None, T), out_spec=P(None, T), mode='unidirectional')
  assert _rel(out, x @ w) < 1e-5 and out.sharding.spec == P(None, T)
  explicit = jax.make_mesh((2, 4), (D, T), devices=devices,
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(ValueError, match=r"needs a mesh whose axes are all Auto; \['data', 'tensor'\]"):
    collective_einsum('bd,df->bf', x, w, mesh=explicit, lhs_spec=P(T, None),
                      rhs_spec=P(None, T), out_spec=P(None, T))


def test_two_axes_decompose_tensor_and_leave_the_other():
  mesh = _mesh(4, data=1)  # fsdp=2
  eq = 'bd,df->bf'
  ls, rs, os_ = P('fsdp', T), P(None, T), P(None, T)  # fsdp: all-gather of b
  d = explain(eq, (8, 8), (8, 8), 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode='unidirectional')
  assert d.axis == T and d.left_to_compiler == ('fsdp',)
  x, w = jax.random.normal(jax.random.key(0), (8, 8)), jax.random.normal(jax.random.key(1), (8, 8))
  fwd, grad = _run(eq, ls, rs, os_, mesh, x, w, 'unidirectional')
  assert _rel(fwd(x, w), x @ w) < 1e-5


def test_a_collective_left_to_the_compiler_is_reported_as_such():
  from parallelism import report  # pylint: disable=import-outside-toplevel
  mesh = _mesh(4, data=1)  # fsdp=2
  specs = (P(None, 'fsdp'), P('fsdp', None), P(None, None))  # an all-reduce over fsdp
  d = explain('bd,df->bf', (8, 8), (8, 8), 'float32', mesh=mesh, lhs_spec=specs[0],
              rhs_spec=specs[1], out_spec=specs[2])
  assert d.mode == 'none' and d.left_to_compiler == ('fsdp',)
  assert report.rows({'x': (d, specs)})[0]['collective'] == "the compiler's over fsdp"


def test_a_gradient_no_ring_can_run_is_not_called_slower():
  """moe_1t's case: embed over (fsdp, expert), so no ring over fsdp, and under 'sharded'
  not the one over tensor: the reason says so rather than that a ring was slower."""
  mesh = jax.sharding.AbstractMesh((2, 8, 2), ('fsdp', T, 'expert'))
  batch = ('fsdp', 'expert')
  d = explain('btd,df->btf', (16, 2048, 8192), (8192, 8192), 'bfloat16', mesh=mesh,
              lhs_spec=P(batch, T, None), rhs_spec=P(batch, T), out_spec=P(batch, None, T),
              hardware='tpu_v4', prefer={'accumulators': 'sharded'})
  assert d.decomposed and d.backward[1] == 'none'
  assert d.reason.endswith("gradient of rhs as one einsum (no ring can run it: under "
                           "accumulators='sharded' not the one over tensor)"), d.reason


# ------------------------------------------------------------------ cost model

def test_cost_model_choices():
  mesh = _mesh(8)
  # Per-step compute hides transfer iff n_local >= b*F/(2B) = 6111 on v4 (technique.md).
  big = dict(lhs_shape=(8192, 8192), rhs_shape=(8192, 65536), dtype='bfloat16',
             mesh=mesh, lhs_spec=P(T, None), rhs_spec=P(None, T), out_spec=P(None, T))
  small = dict(big, lhs_shape=(8192, 8192), rhs_shape=(8192, 64))
  eq = 'bd,df->bf'
  assert explain(eq, **big, hardware='cpu').mode == 'none'  # never pays on CPU
  d = explain(eq, **big, hardware='tpu_v4')
  assert d.mode in ('unidirectional', 'bidirectional'), d
  est = d.estimate
  assert est.step_compute_seconds > est.step_transfer_seconds  # compute hides transfer
  assert est.seconds[d.mode] < est.seconds['none']
  d = explain(eq, **small, hardware='tpu_v4')  # tiny per-step compute: comm-bound
  est = d.estimate
  assert est.step_compute_seconds < est.step_transfer_seconds
  # A unidirectional ring moves every block over one direction: slower than the compiler's
  # collective. A bidirectional one (the opposite block in halves) moves what the
  # compiler's does, so it gains at most the einsum it overlaps.
  assert est.seconds['unidirectional'] > est.seconds['none']
  assert est.seconds['none'] - est.compute_seconds <= est.seconds['bidirectional']


@pytest.mark.parametrize('equation, specs', [
    ('bd,bf->bdf', (P(T, None), P(None, T), P(None, None, T))),  # gathering a shared dim
    ('bc,bc->b', (P(None, T), P(None, T), P(T))),                 # scattering a shared dim
])
def test_a_ring_along_a_dim_of_both_operands_is_refused(equation, specs):
  """A ring slices one operand along its letter: the other holds it whole, so each step's
  einsum would not match (it used to be planned, then fail when traced)."""
  eq, [plan] = einsum_plan.plan(equation, *specs)
  assert plan.kind == 'unsupported', plan
  lhs, rhs = (jax.random.normal(jax.random.key(i), [32] * len(l))
              for i, l in enumerate((eq.lhs, eq.rhs)))
  kw = dict(mesh=_mesh(4), lhs_spec=specs[0], rhs_spec=specs[1], out_spec=specs[2])
  with pytest.raises(ValueError, match=f'cannot decompose {equation} with mode'):
    collective_einsum(equation, lhs, rhs, mode='unidirectional', **kw)
  out = collective_einsum(equation, lhs, rhs, mode='auto', **kw)  # the compiler's collectives
  np.testing.assert_allclose(out, jnp.einsum(equation, lhs, rhs), rtol=1e-5, atol=1e-5)


def test_cost_model_formula_by_hand():
  from parallelism import hardware
  profile = hardware.HardwareProfile('toy', 1e12, 'toy', 1e9, 1, 0.0, True)
  mesh = _mesh(4)
  eq, plans = einsum_plan.plan('bd,df->bf', P(T, None), P(None, T), P(None, T))
  plan = next(p for p in plans if p.axis == T)
  est = cost_model.estimate(eq, plan, (64, 64), (64, 64), 'float32', mesh, profile)
  # 8 devices share 2*64^3 FLOPs; 4 steps; a block is 64*64/8 fp32 values; at the step
  # model's fitted rates.
  peak, link = 1e12 * pricing.MATMUL_EFFICIENCY, 1e9 * pricing.LINK_EFFICIENCY
  c, t = 2 * 64 ** 3 / 8 / peak / 4, 64 * 64 / 8 * 4 / link
  assert est.step_compute_seconds == pytest.approx(c)
  assert est.step_transfer_seconds == pytest.approx(t)
  assert est.seconds['none'] == pytest.approx(4 * c + 3 * t / 2)
  assert est.seconds['unidirectional'] == pytest.approx(c + 3 * max(c, t))
  # Two rounds: two blocks through one einsum, then the opposite block alone, a half of it
  # over each direction (an even ring).
  assert est.seconds['bidirectional'] == pytest.approx(c + max(2 * c, t) + max(c, t / 2))
  assert est.round_compute_seconds == pytest.approx(2 * c)
  # Here a step's transfer outlasts its einsum (t = 128 c): the ring waits for its links.
  assert est.link_bound('unidirectional') and est.link_bound('bidirectional')


def test_a_ring_is_link_bound_where_its_step_or_round_waits_for_its_transfer():
  """One-way, a step's transfer against its einsum; two-way, a round's (one block each
  way) against its einsum over two blocks (decision._backward_forms reads it)."""
  est = cost_model.Estimate('toy', T, 4, 1.0, 0.1, 0.25, 0.3, {}, round_compute_seconds=0.45)
  assert est.link_bound('unidirectional') and not est.link_bound('bidirectional')
  assert not dataclasses.replace(est, step_transfer_seconds=0.2).link_bound('unidirectional')


@pytest.mark.parametrize('bi, expected', [(0.995, 'unidirectional'), (0.98, 'bidirectional'),
                                           (1.2, 'unidirectional')])
def test_a_bidirectional_ring_must_gain_a_margin_over_a_unidirectional_one(bi, expected):
  """A near tie goes to the simpler ring (cost_model.BIDIRECTIONAL_MIN_GAIN)."""
  seconds = {'none': 1.1, 'unidirectional': 1.0, 'bidirectional': bi}
  est = cost_model.Estimate('toy', T, 4, 1.0, 0.1, 0.25, 0.2, seconds)
  assert est.best_ring == est.best == expected
  assert dataclasses.replace(est, seconds=dict(seconds, none=0.9)).best == 'none'


def test_other_axes_are_gathered_before_the_ring_not_inside_it():
  """An FSDP weight is gathered once before the ring; partial sums keep their sharding."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from parallelism.ring_specs import hoisted_specs  # pylint: disable=import-outside-toplevel
  from parallelism.einsum_plan import Equation  # pylint: disable=import-outside-toplevel
  batch = ('data', 'fsdp')
  fwd = hoisted_specs(Equation.parse('btd,df->btf'), 'tensor', P(batch, 'tensor', None),
                      P('fsdp', 'tensor'), P(batch, None, 'tensor'))
  assert fwd == (P(batch, 'tensor', None), P(None, 'tensor'))
  weight_grad = hoisted_specs(Equation.parse('btd,btf->df'), 'tensor',
                              P(batch, 'tensor', None), P(batch, None, 'tensor'),
                              P('fsdp', 'tensor'))
  assert weight_grad == (P(batch, 'tensor', None), P(batch, None, 'tensor'))


def test_weight_gradient_sums_over_batch_axes_once_after_the_ring(devices):
  """A contracted dim sharded over data in both operands: partial sums, one reduction."""
  mesh = _mesh(4, data=2)
  eq, ls, rs, os_ = 'btd,btf->df', P(D, T, None), P(D, None, T), P(None, T)
  x = jax.random.normal(jax.random.key(0), (4, 8, 6))
  g = jax.random.normal(jax.random.key(1), (4, 8, 16))
  f = jax.jit(lambda a, b: collective_einsum(eq, a, b, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                             out_spec=os_, mode='unidirectional'))
  np.testing.assert_allclose(f(x, g), jnp.einsum(eq, x, g), rtol=1e-5, atol=1e-5)
  hlo = f.lower(x, g).compile().as_text()
  assert _collectives(hlo)['all-reduce'] == 1  # over data, after the ring
  assert _collectives(hlo)['all-gather'] == 0
  assert _executed(hlo) == 3


def _bf16_down_projection():
  """``btf,fd->btd`` over data x tensor=8 (an MLP's down projection) with bf16 operands:
  (equation, lhs, rhs and out specs, mesh, lhs, rhs)."""
  return ('btf,fd->btd', P(D, None, T), P(T, None), P(D, T, None), _mesh(8, 1),
          jax.random.normal(jax.random.key(0), (2, 64, 512)).astype(jnp.bfloat16),
          jax.random.normal(jax.random.key(1), (512, 64)).astype(jnp.bfloat16))


@pytest.mark.parametrize('mode', ['unidirectional', 'bidirectional'])
def test_reduce_scatter_accumulators_travel_in_the_compute_dtype(mode):
  # parallelism.ring_dtype: bf16 on the wire halves each step's bytes; every device
  # still adds in fp32, so the error stays that of bf16 rounding, bounded here.
  eq, ls, rs, os_, mesh, lhs, rhs = _bf16_down_projection()
  ref = jnp.einsum(eq, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  outs, hlos = {}, {}
  for ring_dtype in ('compute', 'float32'):
    f = jax.jit(lambda x, w, r=ring_dtype: collective_einsum(
        eq, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_, mode=mode, ring_dtype=r))
    outs[ring_dtype] = f(lhs, rhs)
    # The program we emit (XLA's CPU backend, which has no native bf16, widens the
    # permutes again when it compiles; a TPU keeps them bf16).
    hlos[ring_dtype] = f.lower(lhs, rhs).as_text()
  wire = lambda text: set(re.findall(r'collective_permute.*?\) -> tensor<[\dx]+x(\w+)>', text))
  assert wire(hlos['compute']) == {'bf16'} and wire(hlos['float32']) == {'f32'}
  assert _rel(outs['float32'], ref) < 5e-3  # one bf16 rounding of the result
  assert _rel(outs['compute'], ref) < 1.5e-2  # plus one per hop on the wire
  with pytest.raises(ValueError, match="ring_dtype='int8'"):
    explain(eq, lhs.shape, rhs.shape, 'bfloat16', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
            out_spec=os_, ring_dtype='int8')


@pytest.mark.parametrize('mode', ['unidirectional', 'bidirectional'])
def test_a_rings_additions_of_partial_sums_are_named_in_the_compiled_program(mode):
  # The step model costs them as a term of their own by this name (ring.ADDITIONS_SCOPE).
  eq, ls, rs, os_ = 'btf,fd->btd', P(D, None, T), P(T, None), P(D, T, None)
  mesh = _mesh(8, 1)
  lhs, rhs = jnp.ones((2, 64, 512)), jnp.ones((512, 64))
  f = jax.jit(lambda x, w: collective_einsum(eq, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                             out_spec=os_, mode=mode))
  module = hlo_text.parse(f.lower(lhs, rhs).compile().as_text())
  named = [i for instrs in module.computations.values() for i in instrs
           if f'/{ring_lib.ADDITIONS_SCOPE}/' in i.op_name]
  assert named and all('collective_einsum' in i.op_name for i in named)
  assert len(named) >= 7  # one addition per ring step at least (unrolled on CPU)


@pytest.mark.parametrize('mode', ['unidirectional', 'bidirectional'])
def test_contracting_ring_partial_sums_rest_in_the_compute_dtype(mode):
  # An all-gather ring over a contracted dim (a weight gradient over tensor) adds each
  # block's product into its output: under ring_dtype='compute' that partial sum rests in
  # bf16 between steps (half an fp32 one's memory), each addition in fp32, rounded once.
  eq, ls, rs, os_ = 'btd,btf->df', P(D, T, None), P(D, None, T), P(None, T)
  mesh = _mesh(8, 1)
  lhs = jax.random.normal(jax.random.key(0), (2, 64, 32)).astype(jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(1), (2, 64, 128)).astype(jnp.bfloat16)
  ref = jnp.einsum(eq, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  d = explain(eq, lhs.shape, rhs.shape, 'bfloat16', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode=mode)
  assert d.collective == 'allgather_contracting', d
  outs = {}
  for ring_dtype, want in (('compute', 'bf16'), ('float32', 'f32')):
    f = jax.jit(lambda x, g, r=ring_dtype: collective_einsum(
        eq, x, g, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_, mode=mode, ring_dtype=r))
    outs[ring_dtype] = f(lhs, rhs)
    text = f.lower(lhs, rhs).as_text()
    assert set(re.findall(r'dot_general.*-> tensor<32x16x(\w+)>', text)) == {want}, text
  assert _rel(outs['float32'], ref) < 5e-3  # one bf16 rounding of the result
  assert _rel(outs['compute'], ref) < 1.5e-2  # plus one per ring step


def test_gradients_left_to_the_compiler_carry_the_wire_dtype():
  # A weight gradient computed as one einsum (backward form 'none') leaves its partial
  # sums over the batch to the compiler's reduce-scatter: in bf16 under ring_dtype='compute',
  # as a plain einsum's are (it moved fp32, twice the bytes, before).
  mesh = _mesh(4, data=2)
  eq, ls, rs, os_ = 'btd,df->btf', P(D, T, None), P(None, T), P(D, None, T)
  x = jax.random.normal(jax.random.key(0), (4, 8, 16)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (16, 32)).astype(jnp.bfloat16)
  d = explain(eq, x.shape, w.shape, 'bfloat16', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode='unidirectional')
  d = dataclasses.replace(d, backward=('ring', 'none'))
  ref = jax.grad(lambda w: jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).sum())(w)
  for ring_dtype, want in (('compute', 'bf16'), ('float32', 'f32')):
    grad = jax.jit(jax.grad(lambda w, r=ring_dtype: run_decision(
        dataclasses.replace(d, ring_dtype=r), x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
        out_spec=os_).astype(jnp.float32).sum()))
    text = grad.lower(w).as_text()
    assert set(re.findall(r'dot_general.*-> tensor<16x32x(\w+)>', text)) == {want}
    assert _rel(grad(w), ref) < 2e-2


def test_cost_model_counts_the_wire_dtype_of_reduce_scatter_accumulators():
  mesh = _mesh(8, 1)
  eq, plans = einsum_plan.plan('bf,fd->bd', P(None, T), P(T, None), P(None, T))
  plan = next(p for p in plans if p.axis == T)
  est = lambda wire_fp32: cost_model.estimate(eq, plan, (4096, 4096), (4096, 4096),
                                              'bfloat16', mesh, 'tpu_v4', wire_fp32=wire_fp32)
  lat = 2e-6
  assert (est(True).step_transfer_seconds - lat) == pytest.approx(
      2 * (est(False).step_transfer_seconds - lat))


def test_cost_model_counts_the_flops_of_an_einsum_an_axis_does_not_split():
  # data=2 shards no operand: each of its devices runs the whole einsum over tensor=4, so
  # a device's ring step does a quarter of a quarter of its FLOPs (not an eighth of that).
  mesh = _mesh(4)
  assert dict(mesh.shape)[D] == 2
  b, d, f = 4096, 8192, 8192
  est = explain('bd,df->bf', (b, d), (d, f), 'bfloat16', mesh=mesh, lhs_spec=P(T, None),
                rhs_spec=P(None, T), out_spec=P(None, T), hardware='tpu_v4').estimate
  rate = 275e12 * pricing.MATMUL_EFFICIENCY  # v4's peak at the fitted efficiency
  assert est.step_compute_seconds == pytest.approx(2 * b * d * f / 16 / rate)
  assert est.compute_seconds == pytest.approx(2 * b * d * f / 4 / rate)


def test_cost_model_refuses_rings_whose_steps_are_memory_bound():
  # All-gather over a contracted dim: every step reads and writes the accumulator
  # [b, f/8] (bf16 under ring_dtype='compute'); with d/8 = 256 contracted per step (512
  # per bidirectional round, whose one einsum reads and writes it once) that traffic
  # outlasts the matmul on v4 (1.2 TB/s against 275 TFLOP/s), so the ring loses to the
  # plain einsum, which stays MXU-bound; contracting 8192 per step it is MXU-bound and wins.
  mesh = _mesh(8, 1)
  specs = dict(lhs_spec=P(None, T), rhs_spec=P(None, T), out_spec=P(None, T))
  eq, plans = einsum_plan.plan('bd,df->bf', *specs.values())
  plan = next(p for p in plans if p.axis == T)
  assert plan.kind == 'allgather_contracting'
  b, f = 8192, 65536
  est = lambda d: cost_model.estimate(eq, plan, (b, d), (d, f), 'bfloat16', mesh, 'tpu_v4')
  shallow, deep = est(2048), est(65536)
  assert shallow.step_memory_bound and not deep.step_memory_bound
  # per step: the einsum of an x block and a w slice in bf16, then its addition: the
  # product [b, f/8] written, then it and the accumulator read and their sum written, in
  # the wire dtype (fp32 under 'float32'), an instruction of its own
  rate = 275e12 * pricing.MATMUL_EFFICIENCY
  einsum = max(2 * b * 2048 * f / 64 / rate, 2 * (b * 2048 / 8 + 2048 * f / 64) / 1.2e12)
  step = lambda wire: einsum + 4 * wire * b * f / 8 / 1.2e12
  assert shallow.step_compute_seconds == pytest.approx(step(2))
  fp32 = cost_model.estimate(eq, plan, (b, 2048), (2048, f), 'bfloat16', mesh, 'tpu_v4',
                             wire_fp32=True)
  assert fp32.step_compute_seconds == pytest.approx(step(4))
  assert shallow.step_compute_seconds > 1.5 * (2 * b * 2048 * f / 64 / 275e12)  # its FLOPs
  pick = lambda d: explain('bd,df->bf', (b, d), (d, f), 'bfloat16', mesh=mesh, **specs,
                           hardware='tpu_v4').mode
  assert pick(2048) == 'none' and pick(65536) != 'none'


def test_cost_model_prices_apart_pairs_as_two_einsums_a_round():
  # gather_pairs='apart': a bidirectional all-gather round is two einsums, each reading the
  # weight that stays. Few tokens a block against a wide weight: the round's one einsum reads
  # the weight once, the two read it twice, HBM-bound; many tokens: MXU-bound either way,
  # the same price.
  mesh = _mesh(8, 1)
  eq, plans = einsum_plan.plan('bd,df->bf', P(T, None), P(None, T), P(None, T))
  plan = next(p for p in plans if p.axis == T)
  assert plan.kind == 'allgather_free'
  est = lambda b, apart: cost_model.estimate(eq, plan, (b, 8192), (8192, 65536), 'bfloat16',
                                             mesh, 'tpu_v4', apart_pairs=apart)
  few, many = 8 * 64, 8 * 8192
  assert est(few, True).seconds['bidirectional'] > 1.2 * est(few, False).seconds['bidirectional']
  assert est(many, True).seconds == est(many, False).seconds
  assert est(few, True).seconds['unidirectional'] == est(few, False).seconds['unidirectional']


def test_cost_model_counts_the_copy_of_a_strided_block():
  # A reduce-scatter over d slices its owner w [f/8, d] along its second dim: each step
  # copies the [f/8, d/8] block (written, then read by the einsum) before the einsum.
  # Sliced along its first dim (w [d, f/8]), the block is contiguous: no copy.
  mesh = _mesh(8, 1)

  def step(equation, w_shape, specs):
    eq, plans = einsum_plan.plan(equation, *specs)
    plan = next(p for p in plans if p.axis == T)
    return cost_model.estimate(eq, plan, (64, 4096), w_shape, 'bfloat16', mesh,
                               'tpu_v4').step_compute_seconds
  strided = step('bf,fd->bd', (4096, 4096), (P(None, T), P(T, None), P(None, T)))
  contiguous = step('bf,df->bd', (4096, 4096), (P(None, T), P(None, T), P(None, T)))
  assert strided - contiguous == pytest.approx(2 * 2 * 4096 * 4096 / 64 / 1.2e12)


def test_cost_model_counts_a_weight_gradient_accumulator_whole_over_summed_axes():
  # dW = x^T g over tokens sharded on data (reduced after the ring) and on tensor (the
  # ring): each device accumulates the whole [d, f/4] until the ring ends, not a
  # [d, f] / 8 share; at 256 tokens per step that accumulator makes the ring lose.
  mesh = _mesh(4, data=2)
  eq, ls, rs, os_ = 'btd,btf->df', P(D, T, None), P(D, None, T), P(None, T)
  b, t, d, f = 4, 512, 8192, 8192
  shapes = ((b, t, d), (b, t, f))
  assert local_elements(einsum_plan.Equation.parse(eq), T, *shapes,
                        (ls, rs, os_), mesh)[2] == d * f / 4
  decision = explain(eq, *shapes, 'bfloat16', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                     out_spec=os_, hardware='tpu_v4')
  assert decision.collective == 'allgather_contracting'
  assert decision.estimate.step_memory_bound and decision.mode == 'none'


@pytest.mark.parametrize('pattern', [p for p in PATTERNS if p[0] in ('btd,df->btf', 'bf,fd->bd')],
                         ids=lambda p: p[4])
def test_bidirectional_rings_run_one_einsum_per_step(pattern):
  # Both halves of a round go through one einsum (as XLA's windowed einsum does):
  # 1 + ceil((N-1)/2) einsums for N = 8 instead of N.
  eq, ls, rs, os_, _ = pattern
  mesh = _mesh(8, 1)
  lhs_shape, rhs_shape = _shapes(eq, (ls, rs, os_), mesh, dict.fromkeys('btdfnh', 2))
  args = [jnp.ones(s, jnp.float32) for s in (lhs_shape, rhs_shape)]
  counts = {}
  for mode in ('unidirectional', 'bidirectional'):
    f = jax.jit(lambda x, w, m=mode: collective_einsum(eq, x, w, mesh=mesh, lhs_spec=ls,
                                                       rhs_spec=rs, out_spec=os_, mode=m))
    counts[mode] = _executed(f.lower(*args).compile().as_text(), 'dot')
  assert counts == {'unidirectional': 8, 'bidirectional': 5}


def test_weight_gradient_is_one_einsum_where_its_ring_would_be_memory_bound():
  # x [b, t, d] over (data, tensor) on (b, t), w [d, f] over tensor on f. The forward
  # gathers 256-token blocks; the weight gradient's ring would add each round's product
  # into a [d, f/8] accumulator, HBM-bound on v4 at these widths (with 512-token blocks
  # its bidirectional ring is not): auto keeps the forward ring and computes that
  # gradient as one einsum.
  eq, ls, rs, os_, _ = PATTERNS[0]
  mesh = _mesh(8, 1)
  d = explain(eq, (1, 2048, 8192), (8192, 65536), 'bfloat16', mesh=mesh, lhs_spec=ls,
              rhs_spec=rs, out_spec=os_, hardware='tpu_v4')
  assert d.mode != 'none' and d.backward == ('ring', 'none'), d
  assert 'gradient of rhs as one einsum' in d.reason
  # Values and gradients with that form, on small arrays.
  from parallelism.collective_einsum import run_decision  # pylint: disable=import-outside-toplevel
  lhs = jax.random.normal(jax.random.key(0), (2, 16, 8))
  rhs = jax.random.normal(jax.random.key(1), (8, 16))
  small = explain(eq, lhs.shape, rhs.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                  out_spec=os_, mode='unidirectional')
  forced = dataclasses.replace(small, backward=('ring', 'none'))
  f = lambda x, w: run_decision(forced, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                out_spec=os_)
  _assert_gradients_match_einsum(f, eq, lhs, rhs)
  loss = lambda fn: lambda x, w: jnp.sum(fn(x, w) * weights((2, 16, 16)))
  ring = lambda x, w: run_decision(small, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                   out_spec=os_)
  permutes = lambda fn: _executed(
      jax.jit(jax.grad(loss(fn), argnums=(0, 1))).lower(lhs, rhs).compile().as_text())
  assert permutes(f) == permutes(ring) - 7  # the weight gradient's ring is gone


F = 'fsdp'
B = (D, F)  # the batch over (data, fsdp), data of size 1: the paper configs' layout
DOWN = ('btf,fd->btd', P(B, None, T), P(T, F), P(B, T, None))  # mlp.down, tensor-parallel


def test_weight_gradient_rings_over_fsdp_where_its_reduce_scatter_costs_more():
  # 500B's mlp.down on v4 (fsdp=128 x tensor=8): the weight gradient's partial sums over
  # the batch leave as a compiler reduce-scatter over fsdp, which blocks the chip (3.8 ms
  # a layer, modeled); a bidirectional ring over fsdp computes one 2 x 160-row block of
  # the gradient per round while the last round's accumulators travel. The forward keeps
  # its ring over tensor, and so does the data gradient.
  mesh = jax.sharding.AbstractMesh((1, 128, 8), (D, F, T))
  eq, ls, rs, os_ = DOWN
  d = explain(eq, (256, 2048, 65536), (65536, 20480), 'bfloat16', mesh=mesh, lhs_spec=ls,
              rhs_spec=rs, out_spec=os_, hardware='tpu_v4')
  assert d.axis == T and d.collective == 'reducescatter', d
  assert d.backward == ('ring', 'ring') and d.backward_over == (None, (F, 'bidirectional'))
  assert d.gradient(1) == 'bidirectional over fsdp' and 'rhs bidirectional over fsdp' in d.reason
  # The report's modeled forms of each gradient: the chosen one costs least; each form
  # carries the compiler's collectives over the axes it does not ring.
  forms = d.gradient_seconds[1]
  compiler = lambda a: forms[f"compiler's collective over {a}"]
  assert compiler(F) == pytest.approx(3.8e-3, rel=0.01)
  assert forms['bidirectional over fsdp'] < min(forms['bidirectional over tensor'],
                                                forms['one einsum'])
  assert forms['one einsum'] > compiler(F) + compiler(T)  # its einsum, then both
  assert set(d.gradient_seconds[0]) == {'one einsum', 'unidirectional over tensor',
                                        "compiler's collective over tensor"}
  # 64B's mlp.gate_up (fsdp=64 x tensor=8, 16,384 tokens a tensor group): the ring over
  # fsdp would leave x's gather over tensor to the compiler, which prefetches it, but its
  # transfer holds the tensor links the data gradient's ring needs (compiled, the ring
  # queued behind it: 64B ours 4.700 s a step against 4.649 s with the weight gradient's
  # ring over tensor, modeled with links taking turns). The ring over tensor wins, and runs
  # bidirectional though the forward's is unidirectional (WEIGHT_GRADIENT_MODE).
  mesh64 = jax.sharding.AbstractMesh((1, 64, 8), (D, F, T))
  gate_up = lambda **kw: explain(
      'btd,sdf->btsf', (512, 2048, 8192), (2, 8192, 26112), 'bfloat16', mesh=mesh64,
      lhs_spec=P(B, T, None), rhs_spec=P(None, F, T), out_spec=P(B, None, None, T),
      hardware='tpu_v4', **kw)
  d = gate_up()
  assert d.axis == T and d.mode == 'unidirectional' and d.backward == ('ring', 'ring'), d
  assert d.backward_over == (None, (T, 'bidirectional')), d
  assert d.gradient(0) == 'ring' and d.gradient(1) == 'bidirectional over tensor', d
  # Under a plan's accumulators='sharded' (launch.aot --tune tries both) that ring, whose
  # accumulator holds the [2, d, f/8] gradient whole over fsdp, is no candidate: the ring
  # over fsdp is next best. 'any' is the planner's own.
  d = gate_up(prefer={'accumulators': 'sharded'})
  assert d.backward_over == (None, (F, 'bidirectional')), d
  assert gate_up(prefer={'accumulators': 'any'}) == gate_up()
  # Under 'none' every weight gradient is one einsum, as --tune also compiles; its forms are
  # still priced, for the report.
  d = gate_up(prefer={'accumulators': 'none'})
  assert d.backward == ('ring', 'none') and d.backward_over == (None, None), d
  assert "gradient of rhs as one einsum (accumulators='none')" in d.reason, d.reason
  assert 'bidirectional over tensor' in d.gradient_seconds[1]
  with pytest.raises(ValueError, match="accumulators='whole' is not one of"):
    gate_up(prefer={'accumulators': 'whole'})
  # 64B's attn.qkv at 512 sequences: 1,280 columns a chip, so each of its 64 ring steps over
  # fsdp computes little, and copies its strided block of x ([8, 2048, 128]) first (compiled:
  # 4.588 s a step against 4.527 s for one einsum, modeled before links took turns). Its
  # ring over tensor models cheapest, but a round's 32 MiB transfer (x's block) outlasts
  # its einsum over two blocks, beside the data gradient's ring over tensor: one einsum,
  # whose gather the compiler overlaps with other compute (compiled: 64B 4.6282 -> 4.5605 s
  # a step with attn.o's alike, modeled). gate_up's rounds above outlast their transfers:
  # it rings.
  d = explain('btd,dkgh->btkgh', (512, 2048, 8192), (8192, 8, 10, 128), 'bfloat16',
              mesh=mesh64, lhs_spec=P(B, T, None), rhs_spec=P(F, T, None, None),
              out_spec=P(B, None, T, None, None), hardware='tpu_v4')
  assert d.backward == ('ring', 'none') and d.backward_over == (None, None), d
  forms = d.gradient_seconds[1]
  assert forms['bidirectional over tensor'] < min(forms['one einsum'],
                                                  forms['bidirectional over fsdp']), forms
  assert d.reason.endswith("gradient of rhs as one einsum (its ring over tensor would wait "
                           "for its transfers beside the data gradient's ring)"), d.reason
  # Where data shards the batch too (data=2), the ring over fsdp still sums the batch's
  # partial products; the compiler then sums each block over data.
  mesh = jax.sharding.AbstractMesh((2, 64, 8), (D, F, T))
  d = explain(eq, (512, 2048, 65536), (65536, 20480), 'bfloat16', mesh=mesh, lhs_spec=ls,
              rhs_spec=rs, out_spec=os_, hardware='tpu_v4')
  assert d.backward_over[1][0] == F, d


def test_weight_gradients_ring_over_fsdp_beside_a_plain_forward():
  # v5p's dense_64b layout (data=8 x fsdp=64, no tensor axis): every forward einsum is the
  # compiler's (fsdp shares the batch with data; the weight's gather is prefetched), but
  # each weight gradient's reduce-scatter over fsdp blocks the chip. Under
  # gradient_rings='any_forward' its ring over fsdp costs less (modeled), so the weight
  # gradient alone rings; by default (ringed_forward) nothing does.
  mesh = jax.sharding.AbstractMesh((8, 64, 1), (D, F, T))
  eq, ls, rs, os_ = DOWN
  down = lambda **kw: explain(eq, (1024, 2048, 26112), (26112, 8192), 'bfloat16', mesh=mesh,
                              lhs_spec=ls, rhs_spec=rs, out_spec=os_, **kw)
  assert not down(hardware='tpu_v5p').decomposed
  with pytest.raises(ValueError, match="gradient_rings='all'"):
    down(hardware='tpu_v5p', gradient_rings='all')
  d = down(hardware='tpu_v5p', gradient_rings='any_forward')
  assert d.mode == 'none' and d.axis is None and d.decomposed, d
  assert d.backward == ('none', 'ring') and d.backward_over == (None, (F, 'bidirectional'))
  assert d.gradient(0) == 'none' and d.gradient(1) == 'bidirectional over fsdp', d
  assert d.reason.startswith('fallback to none') and 'rhs bidirectional over fsdp' in d.reason
  # Where nothing is reduce-scattered (no fsdp axis) or nothing overlaps (the CPU), the
  # forward and both gradients stay plain.
  for hardware, shape in (('tpu_v5p', (8, 1, 1)), ('cpu', (8, 64, 1))):
    d = explain(eq, (1024, 2048, 26112), (26112, 8192), 'bfloat16',
                mesh=jax.sharding.AbstractMesh(shape, (D, F, T)), lhs_spec=ls, rhs_spec=rs,
                out_spec=os_, hardware=hardware, gradient_rings='any_forward')
    assert not d.decomposed and d.backward_over == (None, None), (hardware, d)


@pytest.mark.parametrize('mode', ['unidirectional', 'bidirectional'])
@pytest.mark.parametrize('forward', ['bidirectional', 'none'])
def test_weight_gradient_ring_over_fsdp_matches_einsum(mode, forward):
  # Values and both gradients with the weight gradient's ring over fsdp (4 devices) and
  # the forward's and data gradient's over tensor (2), or (forward 'none', data=2 x fsdp=4)
  # beside a plain forward and data gradient, summed over data after the ring; against
  # plain einsums.
  mesh = _mesh(2, data=1) if forward != 'none' else _mesh(1, data=2)
  eq, ls, rs, os_ = DOWN
  x = jax.random.normal(jax.random.key(0), (8, 4, 16))
  w = jax.random.normal(jax.random.key(1), (16, 8))
  d = explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode=forward)
  d = dataclasses.replace(d, backward_over=(None, (F, mode)),
                          backward=('ring' if forward != 'none' else 'none', 'ring'))
  assert d.decomposed
  f = lambda x, w: run_decision(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_)
  _assert_gradients_match_einsum(f, eq, x, w)
  loss = lambda fn: lambda x, w: jnp.sum(fn(x, w) * weights((8, 4, 8)))
  # The gradient's partial sums travel the fsdp ring (3 permutes on a ring of 4, 4 where
  # bidirectional: the opposite block's in halves) instead of a reduce-scatter or
  # all-reduce over fsdp after the einsum.
  no_fsdp_ring = lambda x, w: run_decision(
      dataclasses.replace(d, backward_over=(None, None)), x, w, mesh=mesh, lhs_spec=ls,
      rhs_spec=rs, out_spec=os_)
  for fn, permutes, reduced in ((f, 3 + (mode == 'bidirectional'), False),
                                (no_fsdp_ring, 0, True)):
    module = hlo_text.parse(jax.jit(jax.grad(loss(fn), argnums=(0, 1))).lower(x, w)
                            .compile().as_text())
    assert sum(o != 0 for o in hlo_text.permute_offsets(module, mesh, F)) == permutes
    over = hlo_text.collectives_over(module, mesh, F)
    assert any(re.match(r'(reduce.scatter|all.reduce)', n) for n in over) == reduced, over


def _weight_gradient_over_fsdp(pattern):
  """(mesh, x [8, 4, 16], w [16, 8], decision) for ``pattern`` on tensor=2 x fsdp=4: the
  einsum a bidirectional ring over tensor, its weight gradient a ring over fsdp."""
  mesh = _mesh(2, data=1)
  eq, ls, rs, os_ = pattern
  x = jax.random.normal(jax.random.key(0), (8, 4, 16))
  w = jax.random.normal(jax.random.key(1), (16, 8))
  d = explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode='bidirectional')
  return mesh, x, w, dataclasses.replace(d, backward_over=(None, (F, 'bidirectional')))


def test_contiguous_blocks_lay_out_what_the_weight_gradient_ring_slices():
  # mlp.down's weight gradient rings over fsdp, slicing the cotangent [b, t, d] along d, its
  # minor dim; the data gradient's ring over tensor keeps that cotangent for it. Under
  # block_layout='contiguous' both are laid out with d second-minor ({1,2,0}: each block
  # contiguous, no copy of the whole by the compiler), and the forward reduce-scatter ring's
  # accumulators (an activation) in the default layout, with the same values and gradients.
  eq, ls, rs, os_ = DOWN
  mesh, x, w, d = _weight_gradient_over_fsdp(DOWN)
  for block_layout, pinned in (('compiler', False), ('contiguous', True)):
    f = lambda x, w: _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                  out_spec=os_, layout=block_layout)
    _assert_gradients_match_einsum(f, eq, x, w)
    loss = lambda x, w: jnp.sum(f(x, w) * weights((8, 4, 8)))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w)
    assert ('LayoutConstraint' in lowered.as_text()) == pinned
    # the forward slices no minor dim: its only constraints are the accumulators'
    assert ('LayoutConstraint' in jax.jit(f).lower(x, w).as_text()) == pinned
    assert bool(re.search(r'f32\[\d+,\d+,8\]\{1,2,0\}', lowered.compile().as_text())) == pinned
  with pytest.raises(ValueError, match="layout='tiled'"):
    _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_,
                 layout='tiled')


UP = ('btd,df->btf', P(B, T, None), P(F, T), P(B, None, T))  # mlp.up, sequence-parallel input


@pytest.mark.parametrize('option, default, value, pattern', [
    ('last', 'fused', 'apart', DOWN),
    ('gather', 'beside', 'before', UP)])
def test_ring_schedule_options_add_a_wait_and_keep_the_values(option, default, value,
                                                               pattern):
  # last_contribution='apart': the forward reduce-scatter ring's own contribution goes
  # through an optimization barrier, out of the final additions' fusion (the gradients'
  # rings are as they were). weight_gradient_gather='before': the cotangent waits for the
  # weight gradient's operand, gathered over tensor for its ring over fsdp, before the
  # data gradient's bidirectional ring over tensor. Values and gradients unchanged.
  eq, ls, rs, os_ = pattern
  mesh, x, w, d = _weight_gradient_over_fsdp(pattern)
  assert d.axis == T and d.mode == 'bidirectional'
  barriers = {}
  for choice in (default, value):
    f = lambda x, w, c=choice: _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                    out_spec=os_, **{option: c})
    _assert_gradients_match_einsum(f, eq, x, w)
    loss = lambda x, w, f=f: jnp.sum(f(x, w) * weights(f(x, w).shape))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr
    barriers[choice] = sum(e.primitive.name == 'optimization_barrier' for e in _eqns(jaxpr))
  assert barriers[value] > barriers[default]
  with pytest.raises(ValueError, match=f"{option}='late'"):
    _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_, **{option: 'late'})


def test_operands_gathered_along_their_minor_dim_come_first():
  # mlp.down's weight [f, d] is gathered over fsdp along d, its minor dim: the ring takes
  # it as [d, f] (transposed as a local shard, before the gather). Its weight gradient's
  # ring gathers nothing; a ring that gathers a major dim keeps its operands.
  mesh = _mesh(2, data=1)
  eq, ls, rs, os_ = DOWN
  x, w = jnp.zeros((8, 4, 16)), jnp.zeros((16, 8))
  cfg = Static(eq, mesh, ls, rs, os_, T, True, backward_over=(None, (F, 'bidirectional')))
  moved, _, w_moved = gathered_dims_major(cfg, x, w)
  assert moved.equation == 'btf,df->btd' and moved.rhs_spec == P(F, T)
  assert w_moved.shape == (8, 16)
  grad = cfg.transposed('rhs')
  assert gathered_dims_major(grad, x, jnp.zeros((8, 4, 8)))[0] is grad
  eq, ls, rs, os_, _ = PATTERNS[0]
  cfg = Static(eq, mesh, ls, rs, os_, T, True)
  assert gathered_dims_major(cfg, x, w)[0] is cfg


@pytest.mark.parametrize('rhs_form,gathers', [(('ring', ('fsdp', 'bidirectional')), 1),
                                              (('none', None), 2)])
def test_data_gradient_ring_hands_the_weight_gradient_its_gathered_cotangent(rhs_form, gathers):
  # A reduce-scatter layer (mlp.down, attn.o): its data gradient's ring gathers the
  # cotangent over tensor block by block; a weight gradient that rings over fsdp takes it
  # whole from that ring, not from a second all-gather over the same links (dense_500b:
  # 7.859 -> 7.773 s a step, modeled): the only all-gather left is the weight's over fsdp.
  # One einsum still has the compiler gather it (kept whole, it held memory longer).
  # Values and gradients as a plain einsum's either way.
  mesh = mesh_lib.make_mesh(dict(data=1, fsdp=2, tensor=4, expert=1, dcn_data=1, dcn_fsdp=1,
                                 dcn_tensor=1, dcn_expert=1))
  eq, ls, rs, os_ = 'btf,fd->btd', P(B, None, T), P(T, F), P(B, T, None)
  x = jax.random.normal(jax.random.key(0), (4, 16, 32))
  w = jax.random.normal(jax.random.key(1), (32, 8))
  assert keeps_cotangent(Equation.parse(eq), T, (ls, rs, os_), mesh)
  d = explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode='bidirectional')
  d = dataclasses.replace(d, backward=('ring', rhs_form[0]), backward_over=(None, rhs_form[1]))
  loss = lambda fn: lambda a, b: jnp.sum(fn(a, b) * weights((4, 16, 8)))
  f = lambda a, b: run_decision(d, a, b, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_)
  grad = jax.jit(jax.grad(loss(f), argnums=(0, 1)))
  want = jax.grad(loss(lambda a, b: jnp.einsum(eq, a, b)), argnums=(0, 1))(x, w)
  for a, b in zip(grad(x, w), want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert _collectives(grad.lower(x, w).compile().as_text())['all-gather'] == gathers
  # The forward's own transposes keep nothing: its data gradient reduce-scatters.
  assert not keeps_cotangent(Equation.parse('btd,df->btf'), T,
                             (P(B, T, None), P(F, T), P(B, None, T)), mesh)


def test_ring_output_buffer_is_an_allocation_that_depends_on_its_operand():
  from parallelism import ring  # pylint: disable=import-outside-toplevel
  f = jax.jit(lambda x: ring.fresh_buffer((2, 3), jnp.float32, after=x) + 1)
  x = jnp.ones(4)
  np.testing.assert_array_equal(f(x), np.ones((2, 3)))  # zeros on CPU
  lowered = {p: f.trace(x).lower(lowering_platforms=(p,)).as_text() for p in ('tpu', 'cuda')}
  assert 'AllocateBuffer' in lowered['tpu'] and 'has_side_effect = true' in lowered['tpu']
  assert 'AllocateBuffer' in lowered['cuda'] and 'has_side_effect' not in lowered['cuda']
  # It depends on its operand, so a scan does not hoist it as a loop invariant.
  jaxpr = jax.make_jaxpr(lambda xs: jax.lax.scan(
      lambda c, x: (c, ring.fresh_buffer((2,), jnp.float32, after=x)), 0.0, xs))(jnp.ones((3, 2)))
  body = jaxpr.eqns[-1].params['jaxpr'].jaxpr
  assert any(e.primitive.name == 'ring_buffer' for e in body.eqns)


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
  for e in jaxpr.eqns:
    yield e
    for sub in jax.extend.core.jaxprs_in_params(e.params):
      yield from _eqns(sub)


def _ring_jaxpr(pattern, mode: str):
  """The jaxpr of ``pattern``'s einsum decomposed over a ring of 8 in ``mode``."""
  eq, ls, rs, os_, _ = pattern
  mesh = _mesh(8, 1)
  lhs_shape, rhs_shape = _shapes(eq, (ls, rs, os_), mesh, dict.fromkeys('btdfnh', 2))
  f = lambda x, w: collective_einsum(eq, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                     out_spec=os_, mode=mode)
  return jax.make_jaxpr(f)(jnp.ones(lhs_shape), jnp.ones(rhs_shape)).jaxpr


@pytest.mark.parametrize('mode', ['unidirectional', 'bidirectional'])
def test_reduce_scatter_contributions_wait_for_the_accumulator_sent_beside_them(mode):
  # Each step's einsum takes an operand held back (an optimization barrier) until the
  # accumulator that step sends exists, so the compiler computes it while that
  # accumulator travels, not all of them before the first transfer.
  eqns = list(_eqns(_ring_jaxpr(PATTERNS[3], mode)))
  sent = [v for e in eqns if e.primitive.name == 'ppermute' for v in e.invars]
  held = {}  # barrier output -> its inputs
  for e in eqns:
    if e.primitive.name == 'optimization_barrier':
      held.update({o: e.invars for o in e.outvars})
  waits = [set(held[v]) for e in eqns if e.primitive.name == 'dot_general'
           for v in e.invars if v in held]
  assert sent and waits  # (the ring's loop is one scan in the jaxpr)
  assert all(any(s in w for w in waits) for s in sent)  # every accumulator has its einsum


@pytest.mark.parametrize('pattern', [PATTERNS[0], PATTERNS[2]], ids=['free', 'contracting'])
def test_all_gather_blocks_are_passed_on_after_the_previous_einsum(pattern):
  # Every block a bidirectional all-gather ring passes on (all but the first round's, this
  # device's own shard) is held back (an optimization barrier) until the previous round's
  # einsum has written the accumulator, so each round's einsum overlaps the next transfer.
  eqns = list(_eqns(_ring_jaxpr(pattern, 'bidirectional')))
  held = {o for e in eqns if e.primitive.name == 'optimization_barrier' for o in e.outvars}
  made = {}  # what produced each variable
  for e in eqns:
    made.update({o: e for o in e.outvars})
  def from_held(v):  # the block itself, or a half of it
    while v not in held and v in made and made[v].primitive.name in ('split', 'slice'):
      v = made[v].invars[0]
    return v in held
  sent = [v for e in eqns if e.primitive.name == 'ppermute' for v in e.invars]
  # on a ring of 8: the own shard both ways, the loop's round (one body in the jaxpr) and
  # the opposite block in halves
  assert [from_held(v) for v in sent] == [False, False] + [True] * 4


@pytest.mark.parametrize('pattern', [PATTERNS[0], PATTERNS[3]], ids=['allgather', 'reducescatter'])
def test_weight_gradient_ring_in_another_mode_matches_einsum(pattern):
  # A unidirectional forward whose weight gradient rings bidirectionally over the same
  # axis (WEIGHT_GRADIENT_MODE): values and both gradients against plain einsums; the
  # reduce-scatter forward's data gradient does not hand its gathered cotangent on (that
  # is for a weight gradient over another axis).
  eq, ls, rs, os_, _ = pattern
  mesh, x, w, d = _on_ring_of_8(pattern, 'unidirectional')
  d = dataclasses.replace(d, backward_over=(None, (T, 'bidirectional')))
  assert d.gradient(1) == 'bidirectional over tensor'
  f = lambda x, w: run_decision(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_)
  np.testing.assert_allclose(jax.jit(f)(x, w), jnp.einsum(eq, x, w), rtol=1e-5, atol=1e-5)
  _assert_gradients_match_einsum(f, eq, x, w)


@pytest.mark.parametrize('pattern', [PATTERNS[0], PATTERNS[3]], ids=['allgather', 'reducescatter'])
def test_even_bidirectional_ring_sends_the_opposite_block_in_halves(pattern):
  # On a ring of 8 one device is 4 hops away either way: its block (all-gather) or its
  # accumulator (reduce-scatter) travels as two halves, one each way, so both directions
  # carry 3.5 blocks in 4 transfers (not 4 blocks one way and 3 the other).
  jaxpr = _ring_jaxpr(pattern, 'bidirectional')
  sizes = {+1: [], -1: []}  # by the direction data moves: to the next device or back
  # (the permutes traced: a loop's body once)
  for e in _eqns(jaxpr):
    if e.primitive.name == 'ppermute':
      src, dst = e.params['perm'][0]
      sizes[+1 if (dst - src) % 8 == 1 else -1].append(e.invars[0].aval.size)
  block = max(sizes[+1])
  assert sorted(sizes[+1]) == sorted(sizes[-1]), sizes  # the same transfers each way
  assert [s for s in sizes[+1] if s != block] == [block // 2], sizes  # one of them a half


# ------------------------------------- odd rings, and ring forms the property test misses

def _ring_mesh(tensor: int, fsdp: int = 1):
  """A mesh of ``tensor`` x ``fsdp`` of the 8 devices: odd rings (3, 5) need fewer."""
  return mesh_lib.make_mesh(dict(data=1, fsdp=fsdp, tensor=tensor, expert=1, dcn_data=1,
                                 dcn_fsdp=1, dcn_tensor=1, dcn_expert=1),
                            jax.devices()[:tensor * fsdp])


def _permute_sizes(f, *args, mesh):
  """The bytes of each permute the compiled ``f`` runs (every ring step its own on CPU), by
  the direction data moves along tensor: +1 to the next device, -1 back."""
  module = hlo_text.parse(jax.jit(f).lower(*args).compile().as_text())
  sizes = {+1: [], -1: []}
  permutes = [i for instrs in module.computations.values() for i in instrs
              if i.opcode.removesuffix('-start') == 'collective-permute']
  for ins, offset in zip(permutes, hlo_text.permute_offsets(module, mesh, T)):
    sizes[+1 if offset == 1 else -1].append(hlo_text.shape_bytes(ins.shape))
  return sizes


def _assert_ring_matches_einsum(eq, ls, rs, os_, mesh, x, w, mode, **kw):
  """Values and both gradients of the decomposed einsum against the plain one."""
  f = lambda a, b: collective_einsum(eq, a, b, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                     out_spec=os_, mode=mode, **kw)
  np.testing.assert_allclose(jax.jit(f)(x, w), jnp.einsum(eq, x, w), rtol=1e-5, atol=1e-5)
  _assert_gradients_match_einsum(f, eq, x, w)
  return f


@pytest.mark.parametrize('n', [3, 5])
@pytest.mark.parametrize('pattern', [PATTERNS[0], PATTERNS[2], PATTERNS[3]],
                         ids=lambda p: p[4])
def test_odd_rings_match_einsum(pattern, n):
  # An odd ring has no opposite device: bidirectional, the last round holds the blocks
  # +-(n-1)/2 (all-gather: ring.py's n_right == n_left branch, one einsum for both) or
  # sends both accumulators (n-1)/2 hops (reduce-scatter), no halves; unidirectional,
  # n - 1 steps one way. The gradients' rings (transposed kinds) run odd too.
  eq, ls, rs, os_, kind = pattern
  mesh = _ring_mesh(n)
  x, w = _operands(pattern, mesh, 1)
  assert explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                 out_spec=os_, mode='bidirectional').collective == kind
  for mode in ('unidirectional', 'bidirectional'):
    f = _assert_ring_matches_einsum(eq, ls, rs, os_, mesh, x, w, mode)
    sizes = _permute_sizes(f, x, w, mesh=mesh)
    # whole blocks only; bidirectional: (n-1)/2 each way, unidirectional: n-1 one way
    assert len(set(sizes[+1] + sizes[-1])) == 1, sizes
    want = ((n - 1) // 2,) * 2 if mode == 'bidirectional' else (n - 1, 0)
    assert (len(sizes[+1]), len(sizes[-1])) in (want, want[::-1]), (mode, sizes)


@pytest.mark.parametrize('n', [2, 3, 8])
def test_fused_additions_send_each_accumulator_in_halves_and_keep_the_values(n):
  # parallelism.ring_additions='fused': a reduce-scatter ring (mlp.down, tensor-parallel)
  # sends its accumulators as two halves along d, each step's einsum adding its half's
  # arrival: twice the transfers, each half a block. Values and gradients as the plain
  # einsum's. A d of odd size, or an odd bidirectional ring, keeps whole blocks.
  eq, ls, rs, os_ = 'btf,fd->btd', P(None, None, T), P(T, None), P(None, T, None)
  mesh = _ring_mesh(n)
  x = jax.random.normal(jax.random.key(0), (2, 2 * n, 3 * n))
  sizes = {}
  for mode, d_size, choice in [('unidirectional', 4, 'apart'), ('unidirectional', 4, 'fused'),
                               ('unidirectional', 3, 'fused'), ('bidirectional', 4, 'fused')]:
    w = jax.random.normal(jax.random.key(1), (3 * n, d_size))
    d = explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                out_spec=os_, mode=mode)
    f = lambda x, w, d=d, c=choice: _ran(d, x, w, mesh=mesh, lhs_spec=ls,
                                                 rhs_spec=rs, out_spec=os_, additions=c)
    np.testing.assert_allclose(jax.jit(f)(x, w), jnp.einsum(eq, x, w), rtol=1e-5, atol=1e-5)
    _assert_gradients_match_einsum(f, eq, x, w)
    sizes[mode, d_size, choice] = _permute_sizes(f, x, w, mesh=mesh)
  block = 2 * 2 * 4 * 4  # [b, t / n, d] in fp32
  ways = lambda s: sorted(s[+1] + s[-1])
  assert ways(sizes['unidirectional', 4, 'apart']) == [block] * (n - 1)
  assert ways(sizes['unidirectional', 4, 'fused']) == [block // 2] * (2 * (n - 1))
  assert ways(sizes['unidirectional', 3, 'fused']) == [block * 3 // 4] * (n - 1)
  # even: each way the opposite block's half, then two halves a round; odd: whole blocks
  assert ways(sizes['bidirectional', 4, 'fused']) == (
      [block // 2] * (2 * (n - 1)) if n % 2 == 0 else [block] * (n - 1))


def test_fused_additions_leave_bidirectional_weight_gradient_rings_joined():
  # A bidirectional weight-gradient ring computes both directions' blocks with one einsum,
  # reading the activation once a round; in halves it would take an einsum a direction and
  # read it twice (HBM-bound: dense_500b +0.84 s a step, modeled). Its transfers stay whole.
  eq, ls, rs, os_ = DOWN
  mesh, x, w, d = _weight_gradient_over_fsdp(DOWN)
  sizes = {}
  for choice in ('apart', 'fused'):
    f = lambda x, w, c=choice: _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                            out_spec=os_, additions=c)
    _assert_gradients_match_einsum(f, eq, x, w)
    loss = lambda w, f=f: jnp.sum(f(x, w) * weights((8, 4, 8)))
    module = hlo_text.parse(jax.jit(jax.grad(loss)).lower(w).compile().as_text())
    permutes = [i for instrs in module.computations.values() for i in instrs
                if i.opcode.removesuffix('-start') == 'collective-permute']
    sizes[choice] = sorted(hlo_text.shape_bytes(i.shape) for i, o in
                           zip(permutes, hlo_text.permute_offsets(module, mesh, F)) if o)
  assert sizes['fused'] == sizes['apart'] and sizes['apart'], sizes


def _kernel_weight_gradient(dtype='float32'):
  """DOWN on tensor=2 x fsdp=4 with an MLP of 512 (256 a tensor shard: the pair kernel's
  column halves are whole lane tiles): (mesh, x, w, decision)."""
  mesh = _mesh(2, data=1)
  eq, ls, rs, os_ = DOWN
  x = jax.random.normal(jax.random.key(0), (8, 4, 512)).astype(dtype)
  w = jax.random.normal(jax.random.key(1), (512, 8)).astype(dtype)
  d = explain(eq, x.shape, w.shape, dtype, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode='bidirectional')
  return mesh, x, w, dataclasses.replace(d, backward_over=(None, (F, 'bidirectional')))


def test_kernel_additions_run_each_weight_gradient_round_as_one_pallas_kernel():
  # ring_additions='kernel': as 'fused', and each round of an even bidirectional
  # weight-gradient ring (over fsdp=4 here: one round, two halves) is one call of
  # parallelism/pair_sums.py's kernel (Pallas's interpreter on CPU) for both directions.
  # Gradients as the plain einsum's; the forward's and data gradient's rings have none.
  eq, ls, rs, os_ = DOWN
  mesh, x, w, d = _kernel_weight_gradient()
  kernels = {}
  for choice in ('fused', 'kernel'):
    f = lambda x, w, c=choice: _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                            out_spec=os_, additions=c)
    _assert_gradients_match_einsum(f, eq, x, w)
    loss = lambda x, w, f=f: jnp.sum(f(x, w) * weights((8, 4, 8)))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr
    kernels[choice] = [e for e in _eqns(jaxpr) if e.primitive.name == 'pallas_call']
  assert not kernels['fused'] and len(kernels['kernel']) == 2, kernels


def test_kernel_additions_round_once_a_step_in_bf16():
  # The kernel adds each arriving bf16 accumulator in fp32 and rounds once: the weight
  # gradient's error against fp32 is that of the additions apart.
  eq, ls, rs, os_ = DOWN
  mesh, x, w, d = _kernel_weight_gradient('bfloat16')
  wide = lambda a: a.astype(jnp.float32)
  loss = lambda f: lambda w: jnp.sum(wide(f(x, w)) * weights((8, 4, 8)))
  ref = jax.grad(loss(lambda a, b: jnp.einsum(eq, wide(a), wide(b))))(w)
  errors = {c: _rel(wide(jax.jit(jax.grad(loss(lambda a, b, c=c: _ran(
      d, a, b, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_, additions=c))))(w)),
      ref) for c in ('apart', 'kernel')}
  assert errors['kernel'] < 1.5e-2 and errors['kernel'] < 1.5 * errors['apart'], errors


def test_fused_additions_round_once_a_step_in_bf16():
  # Each step's einsum adds the arriving bf16 accumulator in fp32 and rounds once, as the
  # additions apart do: the error against fp32 stays that of bf16 rounding.
  eq, ls, rs, os_, mesh, lhs, rhs = _bf16_down_projection()
  ref = jnp.einsum(eq, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  d = explain(eq, lhs.shape, rhs.shape, 'bfloat16', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode='unidirectional')
  errors = {c: _rel(jax.jit(lambda x, w, c=c: _ran(
      d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_, additions=c))(
          lhs, rhs), ref) for c in ('apart', 'fused')}
  assert errors['fused'] < 1.5e-2 and errors['fused'] < 1.5 * errors['apart'], errors
  with pytest.raises(ValueError, match="additions='late'"):
    _ran(d, lhs, rhs, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_,
                 additions='late')


def _pairs_dots(d, eq, ls, rs, os_, mesh, x, w):
  """{gather_pairs: (dots the forward executes, dots its gradient executes: the gradient
  rings', the loss being linear)} for ``d``, after checking both settings' values and
  gradients against the plain einsum."""
  dots = {}
  for pairs in ('joined', 'apart'):
    f = lambda x, w, p=pairs: _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs,
                                           out_spec=os_, pairs=p)
    np.testing.assert_allclose(jax.jit(f)(x, w), jnp.einsum(eq, x, w), rtol=1e-5, atol=1e-5)
    _assert_gradients_match_einsum(f, eq, x, w)
    loss = lambda x, w, f=f: jnp.sum(f(x, w))
    dots[pairs] = tuple(_executed(jax.jit(g).lower(x, w).compile().as_text(), 'dot') for g in
                        (f, jax.grad(loss, argnums=(0, 1))))
  return dots


@pytest.mark.parametrize('pattern', [PATTERNS[0], PATTERNS[5], PATTERNS[3]], ids=lambda p: p[0])
def test_gather_pairs_apart_run_an_einsum_a_block_with_the_same_values(pattern):
  # parallelism.gather_pairs='apart': a bidirectional all-gather ring without partial sums
  # (a forward's, or a reduce-scatter layer's data gradient) runs an einsum a block of each
  # round's pair, each product written where it goes: (N-1)//2 more einsums for N = 8 than
  # one over the pair joined. Reduce-scatter and contracting rings keep one einsum a round.
  eq, ls, rs, os_, kind = pattern
  mesh, x, w, d = _on_ring_of_8(pattern, 'bidirectional')
  dots = _pairs_dots(d, eq, ls, rs, os_, mesh, x, w)
  more = [a - j for a, j in zip(dots['apart'], dots['joined'])]
  # the forward's ring (all-gather patterns; their gradients' rings reduce-scatter or
  # contract), or the data gradient's (the reduce-scatter pattern)
  assert more == ([3, 0] if kind == 'allgather_free' else [0, 3]), dots


def test_gather_pairs_apart_in_a_ring_that_keeps_what_it_gathered():
  # mlp.down on tensor=4 x fsdp=2: the data gradient's all-gather ring over tensor also
  # writes the cotangent's blocks whole for the weight gradient's ring over fsdp
  # (keeps_cotangent); apart, its pair's einsums and those writes give the same gradients.
  eq, ls, rs, os_ = DOWN
  mesh = _mesh(4, data=1)
  x = jax.random.normal(jax.random.key(0), (8, 8, 16))
  w = jax.random.normal(jax.random.key(1), (16, 8))
  d = explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode='bidirectional')
  d = dataclasses.replace(d, backward_over=(None, (F, 'bidirectional')))
  dots = _pairs_dots(d, eq, ls, rs, os_, mesh, x, w)
  assert dots['apart'][0] == dots['joined'][0]
  assert dots['apart'][1] == dots['joined'][1] + 1, dots  # one pair round on a ring of 4
  with pytest.raises(ValueError, match="pairs='split'"):
    _ran(d, x, w, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_,
                 pairs='split')


@pytest.mark.parametrize('n', [4, 8])
@pytest.mark.parametrize('pattern', [PATTERNS[2], PATTERNS[6]], ids=lambda p: p[0])
def test_even_bidirectional_rings_match_einsum(pattern, n):
  # The property test draws bidirectional rings of 4 or 8 for few patterns (at n = 2 a
  # bidirectional ring is the unidirectional one): the contracting all-gather and the
  # reduce-scatter over two contracted dims, with the opposite block in halves.
  eq, ls, rs, os_, _ = pattern
  mesh = _mesh(n, data=1)
  x, w = _operands(pattern, mesh, 1)
  _assert_ring_matches_einsum(eq, ls, rs, os_, mesh, x, w, 'bidirectional')


def test_even_bidirectional_ring_without_an_even_dim_sends_the_opposite_block_whole():
  # Every local block [3, 3]: no dim to halve (ring.halves_dim is None), so the opposite
  # device's block travels whole one way: the reduce-scatter forward, the contracting
  # all-gather of x's gradient and the free all-gather of w's all take ring.py's fallback.
  eq, ls, rs, os_ = 'bf,fd->bd', P(None, T), P(T, None), P(None, T)
  mesh = _mesh(4, data=1)
  x = jax.random.normal(jax.random.key(0), (3, 12))
  w = jax.random.normal(jax.random.key(1), (12, 12))
  f = _assert_ring_matches_einsum(eq, ls, rs, os_, mesh, x, w, 'bidirectional')
  sizes = _permute_sizes(f, x, w, mesh=mesh)
  assert set(sizes[+1] + sizes[-1]) == {3 * 3 * 4}, sizes  # whole fp32 blocks, no halves
  assert sorted(map(len, sizes.values())) == [1, 2], sizes  # two transfers one way


@pytest.mark.parametrize('n', [3, 5])
def test_cost_model_odd_bidirectional_ring_by_hand(n):
  # No opposite block: (n-1)/2 rounds of two blocks through one einsum, both directions
  # each carrying one block a round.
  from parallelism import hardware  # pylint: disable=import-outside-toplevel
  profile = hardware.HardwareProfile('toy', 1e12, 'toy', 1e9, 1, 0.0, True)
  mesh = jax.sharding.AbstractMesh((1, n), (D, T))
  eq, plans = einsum_plan.plan('bd,df->bf', P(T, None), P(None, T), P(None, T))
  plan = next(p for p in plans if p.axis == T)
  size = 16 * n
  est = cost_model.estimate(eq, plan, (size, size), (size, size), 'float32', mesh, profile)
  peak, link = 1e12 * pricing.MATMUL_EFFICIENCY, 1e9 * pricing.LINK_EFFICIENCY
  c, t = 2 * size ** 3 / n / peak / n, size * size / n * 4 / link
  assert est.step_compute_seconds == pytest.approx(c)
  assert est.step_transfer_seconds == pytest.approx(t)
  assert est.seconds['unidirectional'] == pytest.approx(c + (n - 1) * max(c, t))
  assert est.seconds['bidirectional'] == pytest.approx(c + (n - 1) // 2 * max(2 * c, t))


@pytest.mark.parametrize('mode', ['unidirectional', 'bidirectional'])
def test_float32_ring_dtype_gradients_of_bf16_operands(mode):
  # ring_dtype='float32' carries the gradients' partial sums in fp32 too: w's gradient (a
  # contracting all-gather ring, 8 steps of partial sums) is within one bf16 rounding of
  # the fp32 gradient, and at least as close as under 'compute' (each step's sum rounded
  # to bf16); x's gradient (a free all-gather, no partial sums) is the same under both.
  eq, ls, rs, os_, mesh, x, w = _bf16_down_projection()
  loss = lambda fn: lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * weights((2, 64, 64)))
  ref = jax.grad(loss(lambda a, b: jnp.einsum(eq, a.astype(jnp.float32),
                                              b.astype(jnp.float32))), argnums=(0, 1))(x, w)
  errors = {}
  for ring_dtype in ('compute', 'float32'):
    f = lambda a, b, r=ring_dtype: collective_einsum(
        eq, a, b, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_, mode=mode, ring_dtype=r)
    grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 2
    errors[ring_dtype] = [_rel(g, r) for g, r in zip(grads, ref)]
  assert max(errors['float32']) < 5e-3, errors
  assert errors['float32'][0] == errors['compute'][0], errors
  assert errors['float32'][1] <= errors['compute'][1], errors


@pytest.mark.parametrize('tensor, mode', [(4, 'unidirectional'), (3, 'unidirectional'),
                                          (3, 'bidirectional')])
def test_data_gradient_ring_hands_on_its_cotangent_in_any_ring(tensor, mode):
  # keeps_cotangent beside a weight gradient over fsdp (as in the test above, there at 4
  # bidirectional): the data gradient's all-gather ring writes each cotangent block that
  # passes into the whole one, unidirectional or odd too; values and gradients as a plain
  # einsum's, and the weight's gather over fsdp is the only all-gather.
  mesh = _ring_mesh(tensor, fsdp=2)
  eq, ls, rs, os_ = 'btf,fd->btd', P(B, None, T), P(T, F), P(B, T, None)
  x = jax.random.normal(jax.random.key(0), (4, 4 * tensor, 8 * tensor))
  w = jax.random.normal(jax.random.key(1), (8 * tensor, 8))
  assert keeps_cotangent(Equation.parse(eq), T, (ls, rs, os_), mesh)
  d = explain(eq, x.shape, w.shape, 'float32', mesh=mesh, lhs_spec=ls, rhs_spec=rs,
              out_spec=os_, mode=mode)
  d = dataclasses.replace(d, backward=('ring', 'ring'), backward_over=(None, (F, mode)))
  f = lambda a, b: run_decision(d, a, b, mesh=mesh, lhs_spec=ls, rhs_spec=rs, out_spec=os_)
  np.testing.assert_allclose(jax.jit(f)(x, w), jnp.einsum(eq, x, w), rtol=1e-5, atol=1e-5)
  _assert_gradients_match_einsum(f, eq, x, w)
  loss = lambda a, b: jnp.sum(f(a, b) * weights((4, 4 * tensor, 8)))
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
  assert _collectives(hlo)['all-gather'] == 1


# --------------------------------------- ring order between rings with position-wise work

GATE = PATTERNS[0][:4]  # btd,df->btf: an all-gather ring over the tokens, tensor-parallel
LOWER = PATTERNS[3][:4]  # btf,fd->btd: a reduce-scatter ring back over them


def _position_wise_chain(n: int, mode: str):
  """(mesh, (x, w1, w2), decisions) for GATE -> silu -> LOWER decomposed over tensor = n."""
  mesh = _ring_mesh(n)
  x = jax.random.normal(jax.random.key(0), (2, 3 * n, 8))
  w1 = jax.random.normal(jax.random.key(1), (8, 2 * n))
  w2 = jax.random.normal(jax.random.key(2), (2 * n, 8))
  decide = lambda pattern, a, b: explain(pattern[0], a.shape, b.shape, 'float32', mesh=mesh,
                                         lhs_spec=pattern[1], rhs_spec=pattern[2],
                                         out_spec=pattern[3], mode=mode)
  h = jnp.einsum(GATE[0], x, w1)
  return mesh, (x, w1, w2), (decide(GATE, x, w1), decide(LOWER, h, w2))


@pytest.mark.parametrize('mode', ['unidirectional', 'bidirectional'])
@pytest.mark.parametrize('n', [4, 5])
def test_tokens_left_in_ring_order_between_two_rings_keep_values_and_gradients(mode, n):
  # The all-gather ring's result stays in the order its blocks arrived (no roll back), the
  # SwiGLU-like work between is position-wise, and the reduce-scatter ring and every
  # gradient ring read that order: the chain's values and all three gradients are the
  # plain chain's, though the gathered result on its own is not the plain einsum's.
  mesh, args, (up, down) = _position_wise_chain(n, mode)
  assert ring_order_fits(up, *GATE[1:], 'out') and ring_order_fits(down, *LOWER[1:], 'lhs')
  run = lambda d, p, a, b, order: run_decision(dataclasses.replace(d, ring_order=order), a, b,
                                               mesh=mesh, lhs_spec=p[1], rhs_spec=p[2],
                                               out_spec=p[3])

  def chain(x, w1, w2, ordered=True):
    h = run(up, GATE, x, w1, 'out' if ordered else '')
    return run(down, LOWER, jax.nn.silu(h) * h, w2, 'lhs' if ordered else '')

  def plain(x, w1, w2):
    h = jnp.einsum(GATE[0], x, w1)
    return jnp.einsum(LOWER[0], jax.nn.silu(h) * h, w2)

  np.testing.assert_allclose(jax.jit(chain)(*args), plain(*args), rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * weights(args[0].shape))
  got = jax.jit(jax.grad(loss(chain), argnums=(0, 1, 2)))(*args)
  want = jax.grad(loss(plain), argnums=(0, 1, 2))(*args)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  gathered = jax.jit(lambda x, w: run(up, GATE, x, w, 'out'))(*args[:2])
  assert not np.allclose(gathered, jnp.einsum(GATE[0], *args[:2]), atol=1e-3)
  if mode == 'unidirectional':  # the joined parts are no longer rolled into place
    rolls = lambda ordered: '_roll_dynamic' in str(jax.make_jaxpr(
        functools.partial(chain, ordered=ordered))(*args))
    assert rolls(False) and not rolls(True)


def test_ring_order_is_refused_where_a_gradient_would_not_read_it():
  # A gradient as one einsum (the compiler's gather keeps the device order), over another
  # axis, a plain forward, or an array the ring does not hold whole: no ring order.
  mesh, (x, w1, _), (up, _) = _position_wise_chain(4, 'unidirectional')
  over_fsdp = (None, ('fsdp', 'bidirectional'))
  for decision, array in ((dataclasses.replace(up, backward=('ring', 'none')), 'out'),
                          (dataclasses.replace(up, backward_over=over_fsdp), 'out'),
                          (dataclasses.replace(up, mode='none'), 'out'),
                          (up, 'lhs')):
    assert not ring_order_fits(decision, *GATE[1:], array)
    with pytest.raises(ValueError, match=f"ring_order='{array}'"):
      run_decision(dataclasses.replace(decision, ring_order=array), x, w1, mesh=mesh,
                   lhs_spec=GATE[1], rhs_spec=GATE[2], out_spec=GATE[3])
