"""The parallelism layer decomposes the model's dense layers by itself."""

import argparse
import copy
import dataclasses
import importlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from parallelism import hlo_text, pair_sums, report, sharding
from tests.test_cli import DEFAULT, TINY
from trainer import loop, state, step, train

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_auto_decomposition')


def _run(workdir, *overrides):
  args = argparse.Namespace(config=DEFAULT, workdir=str(workdir))
  run = train.prepare(args, TINY + ['--config.model.num_layers=2', *overrides])
  train.start_workdir(run, writer_enabled=True)
  return run


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [r['loss'] for r in map(json.loads, f) if 'loss' in r]


FSDP_TENSOR = ['--config.mesh.data=1', '--config.mesh.fsdp=2', '--config.mesh.tensor=4',
               '--config.model.fused_projections=true']


def _prefer(monkeypatch, **prefer):
  """Runs from here on plan their rings with ``prefer``'s schedule settings (as a plan file
  sets them): on the CPU profile the planner's own are the simplest."""
  real = sharding.MatmulPolicy.from_config
  monkeypatch.setattr(sharding.MatmulPolicy, 'from_config', classmethod(
      lambda cls, cfg: dataclasses.replace(real(cfg), prefer=tuple(prefer.items()))))


@pytest.mark.parametrize('layout, prefer', [
    ([], {}), (['--config.model.scan_layers=true', '--config.model.remat=minimal'], {}),
    # unidirectional rings, reduce-scatters' additions fused in halves
    (FSDP_TENSOR, {'additions': 'fused'}),
    # what the planner picks where transfers overlap, on bidirectional rings
    (FSDP_TENSOR + ['--config.model.scan_layers=true', '--config.model.remat=minimal'],
     {'direction': 'bidirectional', 'unroll': 2, 'layout': 'contiguous', 'last': 'apart',
      'gather': 'before', 'pairs': 'apart', 'additions': 'fused'})],
    ids=['layers', 'scanned+remat', 'fsdp+tensor+fused', 'ring-settings'])
def test_always_trains_like_never(tmp_path, monkeypatch, layout, prefer):
  _prefer(monkeypatch, **prefer)
  steps = 20 if not layout else 5
  common = [f'--config.steps={steps}', '--config.log_every=1', '--config.eval_every=0', *layout]
  losses = {}
  for policy in ('never', 'always'):
    run = _run(tmp_path / policy, f'--config.parallelism.collective_matmul={policy}', *common)
    loop.train(run)
    losses[policy] = _losses(run.workdir)
  assert len(losses['always']) == steps
  np.testing.assert_allclose(losses['always'], losses['never'], rtol=1e-4)
  with open(tmp_path / 'always' / 'parallelism_report.json') as f:
    rows = json.load(f)['layers']
  decomposed = {r['path'] for r in rows if r['decision'] in ('unidirectional', 'bidirectional')}
  prefix = 'blocks.*' if '--config.model.scan_layers=true' in layout else 'blocks.1'
  names = (('mlp.gate_up', 'attn.qkv') if '--config.model.fused_projections=true' in layout
           else ('mlp.gate', 'attn.q'))
  assert {f'{prefix}.{n}' for n in names + ('mlp.down', 'attn.o')} | {'unembed'} <= decomposed


@pytest.mark.parametrize('additions', ['apart', 'kernel'])
def test_weight_gradient_rings_beside_plain_forwards_train_like_never(tmp_path, monkeypatch,
                                                                       additions):
  # data=2 x fsdp=4, no tensor axis: every forward einsum is the compiler's, and under
  # the layer override 'gradients' each weight gradient rings over fsdp where the cost model
  # says it pays, which on the CPU profile it never does; here every ring is made to. With
  # the schedule's additions 'kernel' each of their rounds is parallelism/pair_sums.py's
  # kernel (Pallas's interpreter on CPU).
  module = importlib.import_module('parallelism.decision')
  real = module._estimate
  monkeypatch.setattr(module, '_estimate', lambda *a, **k: dataclasses.replace(
      real(*a, **k), compute_seconds=1.0, comm_seconds=1.0,
      seconds={'none': 2.0, 'unidirectional': 1.5, 'bidirectional': 1.1}))
  kernels = []
  real_kernel = pair_sums.pair_sums
  monkeypatch.setattr(pair_sums, 'pair_sums', lambda *a, **k: kernels.append(a[0].shape)
                      or real_kernel(*a, **k))
  common = ['--config.steps=5', '--config.log_every=1', '--config.eval_every=0',
            '--config.mesh.data=2', '--config.mesh.fsdp=4', '--config.mesh.tensor=1',
            '--config.model.scan_layers=true', '--config.model.remat=minimal',
            '--config.parallelism.layer_overrides=blocks.*=gradients']
  _prefer(monkeypatch, additions=additions)
  losses = {}
  for policy in ('never', 'auto'):
    run = _run(tmp_path / policy, f'--config.parallelism.collective_matmul={policy}', *common)
    loop.train(run)
    losses[policy] = _losses(run.workdir)
  assert len(losses['auto']) == 5
  np.testing.assert_allclose(losses['auto'], losses['never'], rtol=1e-4)
  with open(tmp_path / 'auto' / 'parallelism_report.json') as f:
    rows = json.load(f)['layers']
  rings = {r['path'] for r in rows if r['decision'] == 'none' and r['gradients'] == {
      'lhs': 'none', 'rhs': 'bidirectional over fsdp'}}
  assert {f'blocks.*.{n}' for n in ('attn.q', 'attn.o', 'mlp.gate', 'mlp.down')} <= rings, rows
  assert bool(kernels) == (additions == 'kernel'), kernels


def test_layer_overrides_name_layers_by_their_report_paths(tmp_path):
  # parallelism.layer_overrides names layers by the report's paths ('*' matches any part):
  # those run as their form says, with a reason naming the entry; the others as before.
  run = _run(tmp_path / 'ok', '--config.parallelism.collective_matmul=always',
             '--config.parallelism.layer_overrides=blocks.*.attn.o=plain, unembed=plain')
  plan = run.model.ops.plan
  plain = {p: d.reason.split(':')[0] for p, (d, *_) in plan.items() if d.mode == 'none'}
  assert plain == {'blocks.0.attn.o': 'parallelism.layer_overrides blocks.*.attn.o=plain',
                   'blocks.1.attn.o': 'parallelism.layer_overrides blocks.*.attn.o=plain',
                   'unembed': 'parallelism.layer_overrides unembed=plain'}, plain
  assert {'blocks.0.mlp.down', 'blocks.1.attn.q'} <= {
      p for p, (d, *_) in plan.items() if d.mode == 'unidirectional'}
  with pytest.raises(ValueError, match=r"layer_overrides: 'blocks\.\*\.attn\.x' matches no "
                                       r'layer \(the layers: blocks\.0\.attn\.q, '):
    _run(tmp_path / 'bad', '--config.parallelism.layer_overrides=blocks.*.attn.x=plain')
  with pytest.raises(ValueError, match="layer_overrides: 'unembed=flat' is not PATTERN=FORM"):
    _run(tmp_path / 'form', '--config.parallelism.layer_overrides=unembed=flat')


def test_the_mlp_leaves_its_tokens_in_ring_order_only_between_rings(tmp_path):
  # The SwiGLU is position-wise: between its projections' rings and mlp.down's over the
  # same axis, the blocks stay in the order the rings pass them (the always-vs-never
  # losses above run so), as the plan and the report say; with mlp.down plain, its input
  # comes back in order, and so do the projections' results.
  names = ('blocks.0.mlp.gate', 'blocks.0.mlp.up', 'blocks.0.mlp.down')
  run = _run(tmp_path / 'rings', '--config.parallelism.collective_matmul=always')
  assert [run.model.ops.plan[n].decision.ring_order for n in names] == ['out', 'out', 'lhs']
  rows = {r['path']: r for r in report.rows(run.model.ops.plan)}
  assert [rows[n]['ring_order'] for n in names] == ['out', 'out', 'lhs']
  assert rows['blocks.0.attn.o']['ring_order'] is None
  assert 'unidirectional, lhs in ring order' in report.table(list(rows.values()))
  run = _run(tmp_path / 'plain', '--config.parallelism.collective_matmul=always',
             '--config.parallelism.layer_overrides=blocks.*.mlp.down=plain')
  assert [run.model.ops.plan[n].decision.ring_order for n in names] == ['', '', '']


@pytest.fixture(scope='module')
def setups(tmp_path_factory):
  out = {}
  for policy in ('never', 'always'):
    run = _run(tmp_path_factory.mktemp(policy), f'--config.parallelism.collective_matmul={policy}')
    out[policy] = (run, loop.setup(run))
  return out


def _step_0_gradients(s):
  """The parameter gradients of the first batch's loss under setup ``s``."""
  batch = s.get_batch(0)

  def loss(params):
    logits = nnx.merge(s.graphdef, params)(batch['inputs'], batch['positions'],
                                           batch['segments'])
    return step.cross_entropy(logits, batch['targets'], 0.0)[0]

  return jax.block_until_ready(jax.jit(jax.grad(loss))(s.state.params))


def _assert_gradients_agree(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-12


def test_gradients_agree_at_step_0(setups):
  grads = {policy: _step_0_gradients(s) for policy, (_, s) in setups.items()}
  _assert_gradients_agree(grads['always'], grads['never'])


def test_bidirectional_gradients_agree_at_step_0(setups, tmp_path, monkeypatch):
  # Bidirectional rings on every decomposed layer (tensor=4, an even ring: the opposite
  # block in halves) and their gradients' give the plain step's gradients.
  _prefer(monkeypatch, direction='bidirectional')
  run = _run(tmp_path, '--config.parallelism.collective_matmul=always',
             '--config.mesh.data=2', '--config.mesh.tensor=4')
  s = loop.setup(run)
  modes = {d.mode for d, *_ in s.ops.plan.values()}
  assert 'bidirectional' in modes and 'unidirectional' not in modes, modes
  _assert_gradients_agree(_step_0_gradients(s), _step_0_gradients(setups['never'][1]))


def test_compiled_step_has_no_tensor_collective_in_decomposed_layers(setups):
  run, s = setups['always']
  layers = [p for p, (d, *_) in s.ops.plan.items() if d.mode != 'none']
  assert len(layers) == 2 * 7 + 1  # q, k, v, o, gate, up, down per block, and unembed
  in_layers = lambda name: any(f'({p})' in name or f'/{p}/' in name for p in layers)
  found = {}
  for policy, (run, s) in setups.items():
    hlo = s.train_step.lower(s.state, s.get_batch(0)).compile().as_text()
    found[policy] = hlo_text.collectives_over(hlo_text.parse(hlo), run.mesh, 'tensor',
                                              in_layers)
  assert found['never'], 'the plain step must need tensor collectives in these layers'
  assert not found['always'], found['always']


def test_the_plan_is_made_before_tracing_and_tracing_changes_nothing(setups):
  run, s = setups['always']
  ops = s.ops
  fields, plan = dict(vars(ops)), copy.deepcopy(dict(ops.plan))
  for _ in range(2):  # two real traces of the train step (caches cleared in between)
    jax.clear_caches()
    s.train_step.trace(s.state, s.get_batch(0))
    assert vars(ops) == fields and dict(ops.plan) == plan
  fresh = state.model_for_mesh(run.cfg, run.mesh, run.rules)
  assert dict(loop.build(run.cfg, fresh, run.mesh, run.rules).ops.plan) == plan
  with pytest.raises(AttributeError, match='immutable'):
    ops.policy = None
  with pytest.raises(TypeError):
    ops.plan['unembed'] = None


def _saved_residuals(workdir, capsys, *overrides) -> dict[str, list[str]]:
  """What remat 'minimal' keeps of the blocks' forward pass (jax's print_saved_residuals,
  one line each), under collective_matmul=never and =always."""
  saved = {}
  for policy in ('never', 'always'):
    run = _run(workdir / policy, f'--config.parallelism.collective_matmul={policy}',
               '--config.model.remat=minimal', *overrides)
    s = loop.setup(run)
    batch = s.get_batch(0)

    def blocks(params, x_btd, s=s, batch=batch):
      model = nnx.merge(s.graphdef, params)
      return model._run_blocks(x_btd, batch['positions'], batch['segments'])[0].sum()
    x_btd = jnp.zeros((*batch['inputs'].shape, run.cfg.model.d_model))
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(blocks, s.state.params, x_btd)
    saved[policy] = sorted(capsys.readouterr().out.splitlines())
  return saved


def test_minimal_remat_keeps_the_same_tensors_decomposed_or_not(tmp_path, capsys):
  """'minimal' keeps each projection's output by name: a ring's whole output, as a
  plain einsum's, not each ring step's block (jax's dots policy keeps those)."""
  saved = _saved_residuals(tmp_path, capsys, '--config.model.scan_layers=true')
  assert len(saved['never']) > 2 and saved['always'] == saved['never'], saved


def test_a_decomposed_joint_projection_is_kept_by_the_parts_it_is_read_as(tmp_path, capsys):
  """The fused gate/up output: kept whole from a plain einsum (its rounding for remat fuses
  into the einsum), as gate and up from a ring (their roundings fuse into the SwiGLU
  instead of a pass over the ring's buffer); the same bytes either way."""
  saved = _saved_residuals(tmp_path, capsys, '--config.model.fused_projections=true')
  mlp = lambda lines: sorted(re.search(r"named '(mlp_\w+)'", l).group(1) for l in lines
                             if "named 'mlp_" in l)
  assert mlp(saved['never']) == ['mlp_gate_up'] * 2, saved['never']  # two layers
  assert mlp(saved['always']) == ['mlp_gate'] * 2 + ['mlp_up'] * 2, saved['always']
  size = lambda lines: sum(np.prod([int(d) for d in re.search(r'\[([\d,]*)\]', l).group(1)
                                    .split(',') if d]) for l in lines)
  assert size(saved['never']) == size(saved['always'])
