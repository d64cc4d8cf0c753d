"""Optimizer schedules, gradient accumulation and the FLOP formula."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.transformer import Transformer, TransformerConfig
from trainer import metrics, optim
from trainer.config import Optimizer
from trainer.step import TrainState, make_train_step

OPT = dict(learning_rate=1e-2, warmup_steps=10, end_lr_fraction=0.1, b1=0.9, b2=0.95,
           eps=1e-8, weight_decay=0.1, grad_clip=1.0, grad_accum_steps=1, z_loss=0.0)


def test_warmup_then_cosine():
  schedule = optim.learning_rate_schedule(Optimizer(**OPT), 110)
  assert float(schedule(0)) == 0.0
  np.testing.assert_allclose(schedule(5), 5e-3, rtol=1e-6)
  np.testing.assert_allclose(schedule(10), 1e-2, rtol=1e-6)
  np.testing.assert_allclose(schedule(60), 1e-3 + 0.5 * 9e-3, rtol=1e-5)
  np.testing.assert_allclose(schedule(110), 1e-3, rtol=1e-5)


@pytest.mark.parametrize('kind, points', [
    # warmup 10 to the peak 1e-2, 110 steps, end 1e-3 (end_lr_fraction 0.1)
    ('linear', {60: 5.5e-3, 110: 1e-3}),
    ('constant', {60: 1e-2, 110: 1e-2}),
    # decay_fraction 0.2: stable up to step 88, then linear to the end over 22 steps
    ('wsd', {50: 1e-2, 88: 1e-2, 99: 5.5e-3, 110: 1e-3}),
    ('rsqrt', {40: 5e-3, 1000: 1e-3}),  # 1e-2 * sqrt(10 / step)
])
def test_schedule_shapes(kind, points):
  schedule = optim.learning_rate_schedule(
      Optimizer(**OPT | {'schedule': kind, 'decay_fraction': 0.2}), 110)
  assert float(schedule(0)) == 0.0
  np.testing.assert_allclose(schedule(5), 5e-3, rtol=1e-6)  # the same warmup for all
  np.testing.assert_allclose(schedule(10), 1e-2, rtol=1e-6)
  for step, lr in points.items():
    np.testing.assert_allclose(schedule(step), lr, rtol=1e-5, err_msg=f'step {step}')


def test_schedules_without_warmup_start_at_the_peak():
  for kind in optim.SCHEDULES:
    opt = Optimizer(**OPT | {'schedule': kind, 'warmup_steps': 0})
    np.testing.assert_allclose(optim.learning_rate_schedule(opt, 100)(0), 1e-2, rtol=1e-6)
  rsqrt = optim.learning_rate_schedule(
      Optimizer(**OPT | {'schedule': 'rsqrt', 'warmup_steps': 0}), 100)
  np.testing.assert_allclose(rsqrt(3), 5e-3, rtol=1e-6)  # 1e-2 / sqrt(step + 1)


def _tiny(tx):
  """(graphdef, state, batch) of a one-layer model and a batch of 4 x 16 tokens."""
  cfg = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                          num_kv_heads=4, head_dim=8, mlp_dim=64)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
           'positions': jnp.broadcast_to(jnp.arange(16), (4, 16)),
           'segments': jnp.zeros((4, 16), jnp.int32)}
  return graphdef, TrainState(jnp.int32(0), params, tx.init(params)), batch


def test_gradient_accumulation_matches_full_batch():
  tx = optax.sgd(1.0)
  graphdef, state, batch = _tiny(tx)
  full, m_full = jax.jit(make_train_step(graphdef, tx, 0.0, 1))(state, batch)
  accum, m_accum = jax.jit(make_train_step(graphdef, tx, 0.0, 2))(state, batch)
  np.testing.assert_allclose(m_full['loss'], m_accum['loss'], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(accum.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert int(full.step) == 1


def test_an_update_that_overflows_is_not_finite():
  """The loss is of the weights before the update; the update itself can overflow."""
  tx = optax.sgd(1e39)  # inf in float32
  graphdef, state, batch = _tiny(tx)
  new, m = jax.jit(make_train_step(graphdef, tx, 0.0, 1))(state, batch)
  assert np.isfinite(m['loss']) and np.isfinite(m['grad_norm']) and not m['finite']
  assert not all(np.isfinite(x).all() for x in jax.tree.leaves(new.params))
  kept, m = jax.jit(make_train_step(graphdef, tx, 0.0, 1, skip_nonfinite=True))(state, batch)
  assert int(m['skipped']) == 1 and int(kept.step) == 1
  for a, b in zip(jax.tree.leaves(kept.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)


def test_a_skipped_update_keeps_the_moments_and_advances_the_schedule():
  """The learning rate of step k stays schedule(k), as logged, after skipped updates."""
  tx, schedule = optim.make_optimizer(Optimizer(**OPT | {'grad_clip': 0.0}), 20)
  graphdef, state, batch = _tiny(tx)
  poisoned = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), state.params)
  step = jax.jit(make_train_step(graphdef, tx, 0.0, 1, skip_nonfinite=True))
  kept, m = step(TrainState(state.step, poisoned, state.opt_state), batch)
  assert int(m['skipped']) == 1
  counts = lambda s: [x for x in jax.tree.leaves(
      s, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
      if isinstance(x, optax.ScaleByScheduleState)]
  [clock] = counts(kept.opt_state)
  assert int(clock.count) == int(kept.step) == 1  # the schedule's clock moved with the step
  adam = kept.opt_state[0][0]
  assert int(adam.count) == 0 and not any(np.any(x) for x in jax.tree.leaves(adam.mu))
  assert float(schedule(int(clock.count))) > float(schedule(0))  # warming up: it matters


def test_flops_per_token_formula():
  cfg = TransformerConfig(vocab_size=10, d_model=4, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=3, mlp_dim=5)
  # per layer: q,o 4*2*3 each; k,v 4*1*3 each; mlp 3*4*5; output layer 4*10.
  n = 2 * (24 + 24 + 12 + 12 + 60) + 40
  assert metrics.matmul_params(cfg) == n
  assert metrics.flops_per_token(cfg, seq_len=7) == 6 * n + 6 * 2 * 7 * 2 * 3


def _adam_runs(key: str):
  """12 steps of a tiny model under AdamW with ``optimizer.<key>`` param, then bfloat16:
  {value: (losses, the AdamW state, params)}."""
  runs = {}
  for value in ('param', 'bfloat16'):
    tx, _ = optim.make_optimizer(Optimizer(**OPT | {key: value}), 20)
    graphdef, state, batch = _tiny(tx)
    step, losses = jax.jit(make_train_step(graphdef, tx, 0.0, 1)), []
    for _ in range(12):
      state, m = step(state, batch)
      losses.append(float(m['loss']))
    runs[value] = (losses, state.opt_state[1][0], state.params)
  return runs


def _dtypes(*trees):
  return {x.dtype for t in trees for x in jax.tree.leaves(t)}


@pytest.mark.parametrize('key, moment', [('mu_dtype', 'mu'), ('nu_dtype', 'nu')])
def test_a_bfloat16_moment_halves_it_and_stays_close_to_float32(key, moment):
  """optimizer.mu_dtype or nu_dtype 'bfloat16': that AdamW moment is kept in bf16 (the
  other and the weights fp32), and training follows the fp32 run closely."""
  runs = _adam_runs(key)
  (ref, adam32, _), (got, adam16, p16) = runs['param'], runs['bfloat16']
  other = 'nu' if moment == 'mu' else 'mu'
  assert _dtypes(getattr(adam32, moment)) == {jnp.dtype('float32')}
  assert _dtypes(getattr(adam16, moment)) == {jnp.dtype('bfloat16')}
  assert _dtypes(getattr(adam16, other), p16) == {jnp.dtype('float32')}
  assert ref[-1] < ref[0] - 0.5  # it learns, and the bf16 moment learns alike
  np.testing.assert_allclose(got, ref, rtol=1e-2)  # 0.3% apart after 12 steps here
  assert not np.allclose(got[1:], ref[1:], rtol=0, atol=0)  # the option is not a no-op


@pytest.mark.parametrize('scan', [False, True])
def test_weight_decay_applies_to_matrices_only_scanned_or_not(scan):
  """A scanned model's norm scales are stacked ('layers', 'norm'): still not matrices."""
  cfg = TransformerConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=2,
                          num_kv_heads=2, head_dim=8, mlp_dim=32, max_seq_len=16,
                          scan_layers=scan)
  params = nnx.state(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
  tx, _ = optim.make_optimizer(Optimizer(**OPT | {'weight_decay': 0.5, 'warmup_steps': 0}), 10)
  zeros = jax.tree.map(jnp.zeros_like, params)  # no gradient: only the decay moves a weight
  updates, _ = tx.update(zeros, tx.init(params), params)
  moved = {jax.tree_util.keystr(path): bool(jnp.any(u != 0)) for path, u in
           jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(updates))}
  scales = {k for k in moved if k.endswith("['scale']")}
  assert len(scales) == (3 if scan else 5)  # attn_norm, mlp_norm (stacked or per layer), final
  assert not any(moved[k] for k in scales), moved
  assert all(moved[k] for k in moved if k not in scales), moved


def test_scanned_weight_gradients_stack_in_the_compute_dtype():
  """``models.ops.weight``: a scanned bf16 model's layer-weight gradients are stacked in
  bf16, not in the fp32 of the weights (half the bytes of the step's largest gradient
  buffer), with the values a plain cast gives (``model.grads_in_param_dtype``, MaxText's
  program); the train step updates fp32 weights alike."""
  def run(**kw):
    cfg = TransformerConfig(vocab_size=64, d_model=128, num_layers=8, num_heads=4,
                            num_kv_heads=4, head_dim=32, mlp_dim=512, dtype='bfloat16',
                            scan_layers=True, **kw)
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
             'positions': jnp.broadcast_to(jnp.arange(8), (2, 8)),
             'segments': jnp.zeros((2, 8), jnp.int32)}
    tx = optax.sgd(1e-2)
    state = TrainState(jnp.int32(0), params, tx.init(params))
    grads = jax.grad(lambda p: nnx.merge(graphdef, p)(batch['inputs']).astype(
        jnp.float32).mean())(params)
    step = jax.jit(make_train_step(graphdef, tx, 0.0, 1))
    temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    return params, grads, step(state, batch)[0].params, temp

  is_matrix = lambda path: 'scale' not in jax.tree_util.keystr(path)  # not the norms
  matrices = lambda t: [x for path, x in jax.tree_util.tree_leaves_with_path(t['blocks'])
                        if is_matrix(path)]
  dtypes = lambda leaves: {x.dtype.name for x in leaves}
  params, grads, new, temp = run()
  _, grads_cast, new_cast, temp_cast = run(grads_in_param_dtype=True)
  assert dtypes(matrices(grads)) == {'bfloat16'}
  assert dtypes(matrices(grads_cast)) == {'float32'}
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_cast)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), b)
  assert dtypes(jax.tree.leaves(new)) == {'float32'}
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_cast)):
    np.testing.assert_array_equal(a, b)
  # 2 bytes a weight fewer in the stack; the CPU compiler's buffers keep part of that
  # (2.7 of 4.2 MB here), so at least half
  blocks = sum(x.size for x in matrices(params))
  assert temp_cast - temp >= blocks, (temp_cast, temp, blocks)
