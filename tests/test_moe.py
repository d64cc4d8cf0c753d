"""Mixture of Experts: routing, capacity, aux losses, and the expert all-to-all."""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.moe import MoeConfig, MoeMlp, route
from models.ops import Ops
from models.transformer import RESIDUAL
from parallelism import mesh as mesh_lib, sharding
from tests.conftest import ROOT
from trainer import train

D, T, B = 16, 32, 8  # embed, tokens per sequence (group), sequences
RULES = sharding.normalize_rules([['batch', ['data', 'fsdp', 'expert']],
                                  ['batch', ['data', 'fsdp']], ['exp', 'expert'],
                                  ['mlp', 'tensor']])
# moe_1t's layout: a sequence-parallel residual stream, each expert's slots split over
# tensor, so the all-to-all moves each device's own slots and the experts' einsums
# gather and scatter them over tensor (decomposable rings).
SLOT_RULES = sharding.normalize_rules([['batch', ['data', 'fsdp', 'expert']],
                                       ['batch', ['data', 'fsdp']],
                                       ['residual_length', 'tensor'], ['exp', 'expert'],
                                       ['capacity', 'tensor'], ['embed', 'fsdp'],
                                       ['mlp', 'tensor']])
MOE_SMALL = os.path.join(ROOT, 'configs', 'moe_small.py')


def _mesh(**sizes):
  full = dict(data=1, fsdp=1, tensor=1, expert=1, dcn_data=1, dcn_fsdp=1, dcn_tensor=1,
              dcn_expert=1)
  return mesh_lib.make_mesh({**full, **sizes})


def _layer(moe: MoeConfig, ops=None, seed=0):
  return MoeMlp(moe, D, 2, 'float32', 'float32', ops or Ops(), nnx.Rngs(seed))


def _apply(layer, params, x, ops):
  """Output and parameter gradients of a scalar function of the layer's output."""
  graphdef, _ = nnx.split(layer)

  def f(params, x):
    model = nnx.merge(graphdef, params)
    model.ops = ops
    y, aux = model(x, RESIDUAL)
    return jnp.sum(jnp.sin(y)) + aux['load_balance_loss'], (y, aux)

  (_, (y, aux)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params, x)
  return jax.block_until_ready((y, aux, grads))


def _x(seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)


@pytest.mark.parametrize('policy, chunks', [('never', 1), ('always', 2), ('always', 4)])
@pytest.mark.parametrize('sizes, rules', [(dict(data=2, expert=4), RULES),
                                          (dict(expert=2, tensor=2, data=2), RULES),
                                          (dict(fsdp=2, expert=2, tensor=2), SLOT_RULES)],
                         ids=['data2xexpert4', 'expert2xtensor2', 'slots_over_tensor'])
def test_expert_parallel_equals_single_device(devices, sizes, rules, policy, chunks):
  moe = MoeConfig(num_experts=8, top_k=2, mlp_dim=32, overlap_chunks=chunks)
  layer = _layer(moe)
  params = nnx.state(layer)
  ref_y, ref_aux, ref_grads = _apply(layer, params, _x(), Ops())
  mesh, matmul = _mesh(**sizes), sharding.MatmulPolicy(policy)
  plan = sharding.plan_layers(lambda ops: _layer(moe, ops)(_x(), RESIDUAL), mesh=mesh,
                              rules=rules, policy=matmul)
  ops = sharding.ShardedOps(mesh, rules, matmul, plan)
  y, aux, grads = _apply(layer, params, _x(), ops)
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
  for k in aux:
    np.testing.assert_allclose(aux[k], ref_aux[k], rtol=1e-5, atol=1e-6)
  for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)
  decision = plan['moe.exchange'].decision
  sliced = rules is SLOT_RULES  # chunks of slots split over tensor would span devices
  assert (decision.mode, decision.chunks) == (('single', 1) if policy == 'never' or sliced
                                              else ('chunked', chunks))
  if sliced:  # the experts' einsums are rings over tensor where the policy says so
    assert {plan[f'moe.{n}'].decision.axis for n in ('gate', 'up', 'down')} == (
        {None} if policy == 'never' else {'tensor'})


def test_slots_over_tensor_shrink_the_all_to_all_and_ring_the_experts(devices):
  """With capacity over tensor, each all-to-all moves a device's own share of the slots,
  under ``always`` the experts' einsums leave no collective over tensor to the compiler
  (their gathers and reduce-scatters are rings of permutes), and none crosses expert."""
  from parallelism import hlo_text  # pylint: disable=import-outside-toplevel
  moe = MoeConfig(num_experts=8, top_k=2, mlp_dim=32, overlap_chunks=1)
  mesh = _mesh(fsdp=2, expert=2, tensor=2)
  slots = moe.capacity(T)
  layer = _layer(moe)
  graphdef, params = nnx.split(layer)
  experts = lambda name: any(f'moe.{n}' in name for n in ('gate', 'up', 'down'))
  for policy in ('never', 'always'):
    ops = sharding.ShardedOps(mesh, SLOT_RULES, sharding.MatmulPolicy(policy))

    def loss(params, x, ops=ops):
      model = nnx.merge(graphdef, params)
      model.ops = ops
      return jnp.sum(model(x, RESIDUAL)[0])
    text = jax.jit(jax.grad(loss)).lower(params, _x()).compile().as_text()
    module = hlo_text.parse(text)
    a2a = [i for c in module.computations.values() for i in c
           if i.opcode.removesuffix('-start') == 'all-to-all']
    assert a2a and all(  # fp32 [B/4 groups, 8 experts, slots/2, D]: 1/8 of the slots
        hlo_text.shape_bytes(i.shape) == 4 * B // 4 * 8 * (slots // 2) * D
        for i in a2a), [i.shape for i in a2a]
    over_tensor = hlo_text.collectives_over(module, mesh, 'tensor', experts)
    assert bool(over_tensor) == (policy == 'never'), (policy, over_tensor)
    # each device keeps its experts' blocks: nothing crosses expert (the weight gradients'
    # rings once gathered every expert's gradient around their reduction over fsdp)
    assert not hlo_text.collectives_over(module, mesh, 'expert', experts), policy


def test_chunked_routes_identically_and_splits_the_all_to_all(devices):
  mesh = _mesh(data=2, expert=4)
  moe = MoeConfig(num_experts=8, top_k=2, mlp_dim=32, overlap_chunks=4)
  layer = _layer(moe)
  graphdef, params = nnx.split(layer)
  out, hlo = {}, {}
  for policy in ('never', 'always'):
    ops = sharding.ShardedOps(mesh, RULES, sharding.MatmulPolicy(policy))

    def f(params, x, ops=ops):
      model = nnx.merge(graphdef, params)
      model.ops = ops
      return model(x, RESIDUAL)
    compiled = jax.jit(f).lower(params, _x()).compile()
    hlo[policy] = compiled.as_text()
    out[policy] = jax.block_until_ready(compiled(params, _x()))
  (y1, aux1), (y4, aux4) = out['never'], out['always']
  for k in aux1:  # routing happens once, before chunking
    np.testing.assert_array_equal(aux1[k], aux4[k])
  np.testing.assert_allclose(y4, y1, rtol=1e-5, atol=1e-6)
  count = lambda text: sum(' all-to-all(' in line or 'all-to-all-start(' in line
                           for line in text.splitlines())
  assert count(hlo['never']) == 2   # dispatch and combine
  assert count(hlo['always']) == 8  # both, for each of 4 chunks


def test_capacity_drops_by_formula_and_dropless_drops_nothing():
  # A router of zeros ties every expert; top-1 then picks expert 0 for every token.
  for dropless in (False, True):
    moe = MoeConfig(num_experts=4, top_k=1, mlp_dim=32, capacity_factor=1.0,
                    dropless=dropless, overlap_chunks=1)
    layer = _layer(moe)
    layer.router_de[...] = jnp.zeros_like(layer.router_de[...])
    x = _x()
    y, aux = layer(x, RESIDUAL)
    capacity = T if dropless else math.ceil(1.0 * T * 1 / 4)
    assert moe.capacity(T) == capacity
    np.testing.assert_allclose(aux['dropped_fraction'], 1 - capacity / T, atol=1e-7)
    np.testing.assert_allclose(aux['expert_load'], [1, 0, 0, 0])
    # kept tokens: gate 1/E times expert 0's SwiGLU; dropped tokens: 0.
    w = lambda p: p[...][0]
    expert0 = (jax.nn.silu(x @ w(layer.gate_edf)) * (x @ w(layer.up_edf))) @ w(layer.down_efd)
    np.testing.assert_allclose(y[:, :capacity], expert0[:, :capacity] / 4, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[:, capacity:], 0.0)


def test_capacity_is_a_multiple_of_the_chunks():
  moe = MoeConfig(num_experts=8, top_k=2, capacity_factor=1.25, overlap_chunks=4)
  assert moe.capacity(100) == 32  # ceil(1.25 * 100 * 2 / 8) = 32
  assert MoeConfig(num_experts=8, top_k=2, overlap_chunks=3).capacity(100) == 33


def test_aux_losses_match_a_hand_computed_example():
  # Two tokens, two experts; probabilities (1/4, 3/4) for both: both pick expert 1.
  logits = jnp.log(jnp.array([[[1.0, 3.0], [1.0, 3.0]]]))
  r = route(logits, top_k=1, capacity=2)
  # f = (0, 1), P = (1/4, 3/4): E * sum f P = 2 * 3/4.
  np.testing.assert_allclose(r.load_balance_loss, 1.5, rtol=1e-6)
  # logsumexp(log 1, log 3) = log 4 for both tokens.
  np.testing.assert_allclose(r.router_z_loss, np.log(4.0) ** 2, rtol=1e-6)
  np.testing.assert_allclose(r.load_e, [0.0, 1.0])
  # top-1 gate is the probability itself; token 0 in slot 0, token 1 in slot 1.
  np.testing.assert_allclose(r.combine_btec[0, :, 1], [[0.75, 0], [0, 0.75]], rtol=1e-6)
  np.testing.assert_allclose(r.dropped, 0.0)
  # capacity 1: the second token is dropped.
  np.testing.assert_allclose(route(logits, 1, 1).dropped, 0.5)


def test_top2_gates_are_renormalized():
  logits = jnp.log(jnp.array([[[1.0, 2.0, 5.0]]]))  # probs 1/8, 2/8, 5/8
  r = route(logits, top_k=2, capacity=1)
  np.testing.assert_allclose(r.combine_btec[0, 0, :, 0], [0, 2 / 7, 5 / 7], rtol=1e-6)


def test_top2_slots_fill_token_by_token():
  # Two tokens, two experts A and B: t0 prefers A (0.6, 0.4), t1 prefers B (0.3, 0.7).
  # Slots fill in token order, each token's choices in order of preference: with one slot
  # each, t0 takes A and then B, and both of t1's choices drop.
  logits = jnp.log(jnp.array([[[0.6, 0.4], [0.3, 0.7]]]))
  r = route(logits, top_k=2, capacity=1)
  np.testing.assert_array_equal(r.dispatch_btec[0, :, :, 0], [[1, 1], [0, 0]])
  np.testing.assert_allclose(r.combine_btec[0, :, :, 0], [[0.6, 0.4], [0, 0]], rtol=1e-6)
  np.testing.assert_allclose(r.dropped, 0.5)
  np.testing.assert_allclose(r.load_e, [0.5, 0.5])  # before capacity: 2 of 4 each
  # With two slots nothing drops: t0's choices in slot 0 of A and B, t1's in slot 1.
  r = route(logits, top_k=2, capacity=2)
  np.testing.assert_array_equal(r.dispatch_btec[0], [[[1, 0], [1, 0]], [[0, 1], [0, 1]]])
  np.testing.assert_allclose(r.combine_btec[0], [[[0.6, 0], [0.4, 0]], [[0, 0.3], [0, 0.7]]],
                             rtol=1e-6)
  np.testing.assert_allclose(r.dropped, 0.0)


def test_routing_is_causal():
  # Four tokens, four experts, top-2, two slots an expert: whether an earlier token's
  # choice fits never depends on later tokens (filling all first choices first, t0's second
  # choice A dropped when t1 and t2 chose A first, and fitted when t2 chose D).
  prefs = lambda third: jnp.log(jnp.array([[[0.3, 0.6, 0.05, 0.05], [0.7, 0.1, 0.1, 0.1],
                                            third, [0.1, 0.1, 0.7, 0.1]]]))
  a, d = route(prefs([0.7, 0.1, 0.1, 0.1]), 2, 2), route(prefs([0.1, 0.1, 0.1, 0.7]), 2, 2)
  for field in ('dispatch_btec', 'combine_btec'):
    np.testing.assert_array_equal(getattr(a, field)[:, :2], getattr(d, field)[:, :2])
  np.testing.assert_array_equal(a.dispatch_btec[0, 0].sum(-1), [1, 1, 0, 0])  # t0: A and B


def test_moe_small_trains_through_the_cli(tmp_path, capsys):
  workdir = tmp_path / 'moe'
  code = train.main(['--config', MOE_SMALL, '--workdir', str(workdir), '--config.steps=12',
                     '--config.seq_len=64', '--config.log_every=4', '--config.eval_every=0',
                     '--config.eval_steps=2', '--config.checkpoint.every=0'])
  assert code == 0
  assert '2/2 expert all-to-alls chunked' in capsys.readouterr().out
  with open(workdir / 'metrics.jsonl') as f:
    records = [r for r in map(json.loads, f) if 'loss' in r]
  assert records[-1]['loss'] < records[0]['loss'] - 0.5
  load = records[-1]['moe_expert_load']
  assert len(load) == 8 and abs(sum(load) - 1) < 1e-5
  assert 0 <= records[-1]['moe_dropped_fraction'] < 0.5
  assert 0.5 < records[-1]['moe_load_balance_loss'] < 4.0  # 1 when perfectly balanced
  with open(workdir / 'parallelism_report.json') as f:
    rows = {r['path']: r for r in json.load(f)['layers']}
  assert rows['blocks.1.moe.exchange']['decision'] == 'chunked x2'
  assert rows['blocks.1.moe.exchange']['collective'] == 'all_to_all over expert'


def test_exchange_cost_model_and_auto_choice(devices):
  """The modeled times follow parallelism/moe.py's formulas; auto picks the faster."""
  # pylint: disable-next=import-outside-toplevel
  from parallelism import hardware, moe as moe_lib, pricing
  mesh = _mesh(data=2, expert=4)
  shape, itemsize, flops = (64, 8, 128, 1024), 2, 1e12  # [batch, exp, capacity, embed]
  for name, overlaps in (('h100', True), ('tpu_v4', False)):
    chip = hardware.get_profile(name)
    peak, link, _ = pricing.rates(chip)  # the step model's fitted rates
    assert peak < chip.peak_flops or link < chip.link_bandwidth  # not the data sheet's
    # 3/4 of a device's bytes over both ring directions, 2 sequential steps of latency;
    # each of 2 chunks' exchanges moves half the bytes and pays all of the latency
    a = math.prod(shape) * itemsize / 8 * 3 / 4 / (2 * link) + 2 * chip.step_latency
    a_c = a / 2 + chip.step_latency
    t_c = flops / 8 / peak
    seconds = moe_lib.estimate(shape, itemsize, flops, 8, 4, 2, name)
    np.testing.assert_allclose(seconds['single'], 2 * a + t_c)
    # async all-to-alls (GPU) pipeline the chunks; the TPU compiler blocks on them
    chunked = (2 * a_c + t_c / 2 + max(t_c / 2, 2 * a_c) if overlaps else 4 * a_c + t_c)
    np.testing.assert_allclose(seconds['chunked'], chunked)
  auto = lambda hw: moe_lib.decide(shape, itemsize, flops, mesh, 'expert', 2, 'auto', hw)
  assert auto('h100').mode == 'chunked'  # the exchanges overlap expert compute there
  assert auto('tpu_v4').mode == 'single'  # blocking all-to-alls: chunks only add steps
  assert auto('cpu').mode == 'single'      # synchronous copies: chunking only adds steps
  assert moe_lib.decide(shape, itemsize, flops, mesh, None, 2, 'chunked', 'cpu').reason == (
      'no expert parallelism: no all-to-all')
  alone = moe_lib.decide(shape, itemsize, flops, _mesh(data=8, expert=1), 'expert', 2, 'auto',
                         'cpu')  # an expert axis of one device: nothing to exchange
  assert alone.axis is None and alone.reason == 'no expert parallelism: no all-to-all'
  # tokens held alike on both data devices: each sends twice the bytes of a split layout
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  held = moe_lib.decide(shape, itemsize, flops, mesh, 'expert', 1, 'auto', 'tpu_v4',
                        P('expert', None, None, None))
  assert held.seconds == moe_lib.estimate(shape, itemsize, flops, 8, 4, 1, 'tpu_v4', shards=4)
  assert held.seconds['single'] > moe_lib.estimate(shape, itemsize, flops, 8, 4, 1,
                                                   'tpu_v4')['single']
  sliced = moe_lib.decide(shape, itemsize, flops, mesh, 'expert', 2, 'chunked', 'cpu',
                          P('expert', None, 'data', None))
  assert (sliced.mode, sliced.reason) == ('single', "capacity is split over data: a chunk of "
                                          'slots would span devices')


def test_exchange_chunks_only_where_each_chunk_keeps_the_mxus_busy(devices):
  """Each chunk's experts read all of a device's expert weights again: where those reads
  outlast a chunk's FLOPs, chunking loses (parallelism/moe.py's T(C))."""
  # pylint: disable-next=import-outside-toplevel
  from parallelism import hardware, moe as moe_lib, pricing
  mesh = _mesh(data=2, expert=4)
  shape, itemsize, flops = (64, 8, 128, 1024), 2, 1e12
  chip = hardware.get_profile('h100')
  peak, link, _ = pricing.rates(chip)  # the step model's fitted rates
  tokens = math.prod(shape) * itemsize / 8  # a device's dispatched bytes
  a = tokens * 3 / 4 / (2 * link) + 2 * chip.step_latency
  a_c = a / 2 + chip.step_latency
  weights = 1e9  # a device's experts, read once per pass over its tokens
  t = lambda parts: max(flops / 8 / parts / peak,
                        (weights + 2 * tokens / parts) / chip.hbm_bandwidth)
  seconds = moe_lib.estimate(shape, itemsize, flops, 8, 4, 2, 'h100', weight_bytes=weights)
  np.testing.assert_allclose(seconds['single'], 2 * a + t(1))
  np.testing.assert_allclose(seconds['chunked'], 2 * a_c + t(2) + max(t(2), 2 * a_c))
  assert t(2) > flops / 8 / 2 / peak  # a chunk is bound by the weights' reads
  pick = lambda w: moe_lib.decide(shape, itemsize, flops, mesh, 'expert', 2, 'auto', 'h100',
                                  weight_bytes=w).mode
  assert pick(0.0) == 'chunked' and pick(weights) == 'single'


def test_exchange_cost_agrees_with_the_step_model():
  """The all-to-all term of the MoE cost model is the step model's, for the same bytes."""
  from parallelism import hlo_text, moe as moe_lib, step_model  # pylint: disable=import-outside-toplevel
  shape, itemsize = (64, 8, 128, 1024), 2
  per_device = math.prod(shape) * itemsize // 8
  ins = hlo_text.parse_instr(f'  %a2a = bf16[{per_device // 2}]{{0}} all-to-all(%x), '
                             'replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}')
  chip = step_model.Chip.from_profile('tpu_v4')
  a = step_model.collective_seconds(ins, per_device, chip, 8)
  seconds = moe_lib.estimate(shape, itemsize, 0.0, 8, 4, 1, 'tpu_v4')
  experts = 2 * per_device / chip.hbm_bandwidth  # no FLOPs: the tokens read and written
  np.testing.assert_allclose(seconds['single'], 2 * a + experts)


@pytest.mark.parametrize('key, value, message', [
    ('moe.num_experts', -1, 'moe.num_experts=-1 must be >= 0'),
    ('moe.capacity_factor', math.inf, 'moe.capacity_factor=inf must be finite and > 0'),
    ('moe.load_balance_weight', -0.1, 'moe.load_balance_weight=-0.1 must be >= 0'),
    ('moe.router_z_weight', math.nan, 'moe.router_z_weight=nan must be >= 0')])
def test_bad_moe_settings_are_refused_naming_the_value(key, value, message):
  from trainer import config as config_lib, validation  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(MOE_SMALL, []).replace({key: value})
  with pytest.raises(ValueError, match=re.escape(message)):
    validation.validate(cfg)


def test_experts_split_over_two_mesh_axes_are_refused():
  """parallelism/moe.py exchanges over one axis; an 'exp' rule over two was run as if there
  were no expert parallelism, the compiler moving the tokens unreported."""
  from trainer import config as config_lib, validation  # pylint: disable=import-outside-toplevel
  cfg = config_lib.load(MOE_SMALL, [])
  rules = [r if r[0] != 'exp' else ['exp', ['expert', 'tensor']]
           for r in cfg.mesh.logical_axis_rules]
  cfg = cfg.replace({'mesh.logical_axis_rules': rules})
  with pytest.raises(ValueError, match=r"split 'exp' over expert\*tensor"):
    validation.check_layout(cfg, {'data': 1, 'fsdp': 1, 'expert': 4, 'tensor': 2}, None)


@pytest.mark.parametrize('in_param_dtype', [False, True])
def test_expert_weight_gradients_stay_in_the_compute_dtype(in_param_dtype):
  """``models.ops.weight`` in the experts and router: bf16 gradients for fp32 weights,
  the same values as a plain cast's (``grads_in_param_dtype``)."""
  moe = MoeConfig(num_experts=4, top_k=2, mlp_dim=32, overlap_chunks=1)

  def grads(in_param_dtype):
    layer = MoeMlp(moe, D, 2, 'bfloat16', 'float32', Ops(), nnx.Rngs(0),
                   grads_in_param_dtype=in_param_dtype)
    graphdef, params = nnx.split(layer)
    return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(
        _x().astype(jnp.bfloat16), RESIDUAL)[0].astype(jnp.float32)))(params)

  got = grads(in_param_dtype)
  assert {g.dtype.name for g in jax.tree.leaves(got)} == {
      'float32' if in_param_dtype else 'bfloat16'}
  if not in_param_dtype:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(grads(True))):
      np.testing.assert_array_equal(np.asarray(a, np.float32), b)
