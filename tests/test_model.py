"""Model: shapes, causality, document isolation, scan and sharding equivalence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.transformer import Transformer, TransformerConfig, count_params
from parallelism import mesh as mesh_lib, sharding
from trainer import metrics

SMALL = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp_dim=64, max_seq_len=64)


def _model(**kw):
  return Transformer(TransformerConfig(**{**SMALL, **kw}), nnx.Rngs(0))


def _tokens(b=2, t=16, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL['vocab_size'])


@pytest.mark.parametrize('kw', [{}, {'scan_layers': True, 'remat': 'full'},
                                {'tie_embeddings': True}, {'num_kv_heads': 4}])
def test_shapes_and_param_count(kw):
  model = _model(**kw)
  logits = model(_tokens())
  assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32
  cfg = model.cfg
  expected = metrics.matmul_params(cfg) + 2 * cfg.num_layers * cfg.d_model + cfg.d_model
  expected += 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
  assert count_params(nnx.state(model)) == expected


@pytest.mark.parametrize('tie', [False, True])
def test_initial_loss_is_near_a_uniform_guess(tie):
  # Tied, the embedding is also the output layer: drawn with std 1 (an untied embedding's),
  # each position's logit for its own input token started near d_model and the loss far
  # above ln(vocab) (117 nats here instead of 4.2).
  model = _model(tie_embeddings=tie, d_model=128)
  tokens = _tokens()
  logits = model(tokens)[:, :-1]
  loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
  assert abs(float(loss) - np.log(SMALL['vocab_size'])) < 1.0


def test_every_weight_names_logical_axes():
  allowed = {'embed', 'mlp', 'heads', 'kv_heads', 'head_dim', 'vocab', 'layers', 'norm'}
  state = nnx.state(_model(scan_layers=True))
  for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    axes = var.get_metadata()['out_sharding']
    assert len(axes) == var.ndim and set(axes) <= allowed, axes


def test_causal():
  model = _model()
  tokens = _tokens(b=1, t=16)
  changed = tokens.at[0, 9].set((tokens[0, 9] + 1) % 64)
  a, b = model(tokens), model(changed)
  np.testing.assert_array_equal(a[:, :9], b[:, :9])
  assert not np.allclose(a[:, 9:], b[:, 9:])


def test_packed_documents_do_not_attend_across_boundaries():
  model = _model()
  tokens = _tokens(b=1, t=16)
  segments = jnp.array([[0] * 6 + [1] * 10])
  positions = jnp.array([list(range(6)) + list(range(10))])
  changed = tokens.at[0, 2].set((tokens[0, 2] + 1) % 64)  # inside document 0
  a = model(tokens, positions, segments)
  b = model(changed, positions, segments)
  np.testing.assert_array_equal(a[:, 6:], b[:, 6:])
  # Document 1 alone, at positions 0..9, gives the same logits as when packed.
  alone = model(tokens[:, 6:], positions[:, 6:], segments[:, 6:])
  np.testing.assert_allclose(alone, a[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('unroll', [1, 2])
def test_scanned_equals_unrolled(unroll):
  looped, scanned = _model(), _model(scan_layers=True, scan_unroll=unroll)
  src, dst = nnx.state(looped), nnx.state(scanned)
  for key in list(dst.keys()):
    dst[key] = src[key]
  dst['blocks'] = jax.tree.map(lambda *xs: jnp.stack(xs),
                               *[src['blocks'][i] for i in range(SMALL['num_layers'])])
  nnx.update(scanned, dst)
  tokens = _tokens()
  np.testing.assert_allclose(looped(tokens), scanned(tokens), rtol=1e-5, atol=1e-5)



def test_scan_unroll_puts_two_blocks_in_the_loop_body():
  def program(unroll):
    model = _model(num_layers=4, scan_layers=True, scan_unroll=unroll)
    return jax.jit(lambda t: model(t)).lower(_tokens()).compile().as_text()
  one, two = program(1), program(2)
  assert one.count(' while(') == two.count(' while(') == 1
  per_block = two.count(' dot(') - one.count(' dot(')  # the body's second block
  assert per_block >= 5 and one.count(' dot(') > per_block


def test_cast_in_loop_keeps_each_layers_cast_in_the_scan_and_changes_nothing_else():
  # The barrier (model.cast_in_loop) is what stops a TPU compiler from casting every
  # layer's stacked weights before the loop; the values and gradients are the same.
  kw = dict(num_layers=4, scan_layers=True, remat='minimal', dtype='bfloat16')
  plain, barred = (nnx.split(_model(**kw, cast_in_loop=c)) for c in (False, True))
  tokens = _tokens()
  def loss(graphdef):
    return jax.jit(jax.value_and_grad(
        lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)))
  (a, grad_a), (b, grad_b) = loss(plain[0])(plain[1]), loss(barred[0])(barred[1])
  assert a == b
  for x, y in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)):
    np.testing.assert_array_equal(x, y)
  texts = [loss(g).lower(p).as_text() for g, p in (plain, barred)]
  counts = [t.count('optimization_barrier') for t in texts]  # remat's own, then ours
  assert counts[1] >= counts[0] + 2, counts  # in the forward and in the backward scan


def test_fused_projections_compute_the_same_model():
  # One einsum over joined q/k/v (and gate/up) weights: the same parameters, values
  # and gradients as one einsum per projection.
  cfg = TransformerConfig(**{**SMALL, 'num_kv_heads': 2})
  fused = TransformerConfig(**{**SMALL, 'num_kv_heads': 2, 'fused_projections': True})
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
  fused_def, fused_params = nnx.split(Transformer(fused, nnx.Rngs(0)))
  assert jax.tree.structure(params) == jax.tree.structure(fused_params)
  tokens = _tokens()
  loss = lambda g: jax.value_and_grad(lambda p: jnp.mean(nnx.merge(g, p)(tokens) ** 2))
  (a, grad_a), (b, grad_b) = loss(graphdef)(params), loss(fused_def)(params)
  np.testing.assert_allclose(a, b, rtol=1e-6)
  for x, y in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_sharded_forward_equals_unsharded(devices):
  mesh = mesh_lib.make_mesh(dict(data=2, fsdp=1, tensor=4, expert=1, dcn_data=1,
                                 dcn_fsdp=1, dcn_tensor=1, dcn_expert=1), devices)
  rules = sharding.normalize_rules([['batch', ['data', 'fsdp']], ['vocab', 'tensor'],
                                    ['embed', 'fsdp'], ['mlp', 'tensor'],
                                    ['heads', 'tensor'], ['kv_heads', 'tensor']])
  cfg = TransformerConfig(**{**SMALL, 'num_kv_heads': 4})  # kv heads split over tensor=4
  reference = Transformer(cfg, nnx.Rngs(0))
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0), sharding.ShardedOps(mesh, rules)))
  specs = sharding.state_specs(params, rules)
  params = jax.device_put(params, sharding.named(mesh, specs))
  assert params['blocks'][0]['mlp']['gate_df'][...].sharding.spec == P('fsdp', 'tensor')
  tokens = jax.device_put(_tokens(b=4), NamedSharding(mesh, sharding.logical_to_spec(
      ('batch', 'length'), rules)))
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
  out = forward(params, tokens)
  np.testing.assert_allclose(out, reference(_tokens(b=4)), rtol=1e-5, atol=1e-5)
  hlo = forward.lower(params, tokens).compile().as_text()
  assert 'all-reduce' in hlo or 'all-gather' in hlo  # it really ran sharded


def test_bad_model_config():
  with pytest.raises(ValueError, match='num_kv_heads=3'):
    _model(num_kv_heads=3)
  with pytest.raises(ValueError, match="remat='some'"):
    _model(remat='some')
  with pytest.raises(ValueError, match='scan_unroll=3 does not divide the 2 scanned units'):
    _model(scan_layers=True, scan_unroll=3)


def _grad_and_dots(remat, fused):
  """Gradient of a scanned model's loss, and the dot products in its program."""
  model = _model(scan_layers=True, remat=remat, fused_projections=fused)
  graphdef, state = nnx.split(model)
  loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(_tokens()) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss))(state)
  dots = str(jaxpr).count('dot_general')
  return jax.grad(loss)(state), dots


@pytest.mark.parametrize('fused', [False, True])
def test_remat_policies_recompute_less_and_agree(fused):
  """'save_dot_except_mlp' keeps the attention projections and 'save_dot_except_qkv'
  all but q/k/v, so their backward passes repeat fewer dot products than 'full' and more
  than 'minimal'; every policy gives the same gradient as none."""
  ref, none_dots = _grad_and_dots('none', fused)
  dots = {}
  for remat in ('full', 'save_dot_except_mlp', 'save_dot_except_qkv', 'minimal'):
    grad, dots[remat] = _grad_and_dots(remat, fused)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grad, ref)
  assert dots['full'] > dots['save_dot_except_mlp'] > dots['minimal'] >= none_dots, dots
  assert dots['full'] > dots['save_dot_except_qkv'] > dots['minimal'], dots
