"""Blockwise, splash and cuDNN-API attention against the plain one; which one 'auto' picks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import attention
from models.attention import attend_blockwise, attend_cudnn, attend_splash
from models.transformer import Transformer, TransformerConfig, attend
from parallelism import mesh as mesh_lib, sharding
from tests.test_cli import DEFAULT, TINY
from trainer import train


def _inputs(b, t, n, k, h, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h)).astype(dtype)
  kk = jax.random.normal(keys[1], (b, t, k, h)).astype(dtype)
  v = jax.random.normal(keys[2], (b, t, k, h)).astype(dtype)
  # Packed documents of random lengths (segment ids rise along each row).
  seg = jnp.cumsum(jax.random.bernoulli(keys[3], 0.1, (b, t)), axis=1)
  return q, kk, v, seg


def _loss(fn, seg):
  w = jnp.cos(jnp.arange(4096.0))
  return lambda q, kk, v: jnp.sum(fn(q, kk, v, seg).astype(jnp.float32)
                                  * w[:q.shape[-1]])


@pytest.mark.parametrize('t,block,n,k', [(32, 8, 4, 4), (64, 16, 4, 2), (48, 48, 8, 1)])
def test_values_and_gradients_match_the_plain_attention(t, block, n, k):
  q, kk, v, seg = _inputs(2, t, n, k, 16, jnp.float32)
  ref = attend(q, kk, v, seg)
  out = attend_blockwise(q, kk, v, seg, block)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  blockwise = lambda q, kk, v, seg: attend_blockwise(q, kk, v, seg, block)
  g_ref = jax.grad(_loss(attend, seg), argnums=(0, 1, 2))(q, kk, v)
  g = jax.grad(_loss(blockwise, seg), argnums=(0, 1, 2))(q, kk, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_within_bf16_error():
  q, kk, v, seg = _inputs(2, 64, 4, 2, 32, jnp.bfloat16, seed=3)
  ref = attend(*(x.astype(jnp.float32) for x in (q, kk, v)), seg)
  out = attend_blockwise(q, kk, v, seg, 16).astype(jnp.float32)
  plain = attend(q, kk, v, seg).astype(jnp.float32)
  assert float(jnp.abs(out - ref).max()) <= 2 * float(jnp.abs(plain - ref).max()) + 1e-2


@pytest.mark.parametrize('n,k', [(4, 4), (4, 2)])
def test_cudnn_masks_match_the_plain_attention(n, k):
  """The causal and document masks as 'cudnn' passes them, run by XLA (no GPU here)."""
  q, kk, v, seg = _inputs(2, 32, n, k, 16, jnp.float32, seed=5)
  via_api = lambda q, kk, v, seg: attend_cudnn(q, kk, v, seg, implementation='xla')
  np.testing.assert_allclose(via_api(q, kk, v, seg), attend(q, kk, v, seg), atol=2e-5, rtol=2e-5)
  g_ref = jax.grad(_loss(attend, seg), argnums=(0, 1, 2))(q, kk, v)
  g = jax.grad(_loss(via_api, seg), argnums=(0, 1, 2))(q, kk, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('platform, dtype, head_dim, seq_len, picked', [
    ('gpu', 'bfloat16', 128, 2048, 'cudnn'),
    ('gpu', 'float32', 128, 2048, 'blockwise'),   # cuDNN takes bf16/fp16 only
    ('gpu', 'bfloat16', 12, 256, 'xla'),          # head_dim not a multiple of 8; one block
    ('tpu', 'bfloat16', 128, 2048, 'splash'),
    ('tpu', 'bfloat16', 128, 1000, 'xla'),        # splash and blockwise blocks do not divide it
    ('gpu', 'float32', 128, 4096, 'blockwise'),   # several key blocks: never the whole logits
    ('cpu', 'float32', 32, 256, 'xla'),           # one block: nothing to save (make train)
    ('cpu', 'float32', 32, 4096, 'blockwise'),
    ('cpu', 'float32', 32, 1000, 'xla'),          # the block does not divide the length
])
def test_auto_picks_per_platform(platform, dtype, head_dim, seq_len, picked):
  assert attention.choose('auto', platform, dtype, head_dim, seq_len, 512) == picked
  assert attention.choose('xla', platform, dtype, head_dim, seq_len, 512) == 'xla'


@pytest.mark.parametrize('kernel, platform, dtype, seq_len, message', [
    ('cudnn', 'cpu', 'bfloat16', 2048, "'cudnn' runs on an NVIDIA GPU, this run is on the cpu"),
    ('cudnn', 'gpu', 'float32', 2048, "cannot run model.dtype='float32'"),
    ('splash', 'gpu', 'bfloat16', 2048, "'splash' runs on a TPU, this run is on the gpu"),
    ('splash', 'tpu', 'bfloat16', 2000, 'seq_len=2000 with model.attention_block=512'),
])
def test_kernels_are_refused_where_they_cannot_run(kernel, platform, dtype, seq_len, message):
  with pytest.raises(ValueError, match=message):
    attention.choose(kernel, platform, dtype, 128, seq_len, 512)


def test_kernels_run_where_they_can_and_auto_needs_a_platform():
  assert attention.choose('cudnn', 'gpu', 'float16', 64, 2048, 512) == 'cudnn'
  assert attention.choose('splash', 'tpu', 'bfloat16', 128, 256, 512) == 'splash'
  model = Transformer(TransformerConfig(attention='auto'), nnx.Rngs(0))
  with pytest.raises(ValueError, match="'auto' is chosen per platform"):
    model(jnp.zeros((1, 8), jnp.int32), segments_bt=jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize('n,k', [(4, 4), (4, 2)])
def test_splash_kernel_matches_the_plain_attention(n, k):
  """The TPU kernel run by the Pallas interpreter: values and gradients, GQA, documents."""
  q, kk, v, seg = _inputs(2, 256, n, k, 128, jnp.float32, seed=7)
  splash = lambda q, kk, v, seg: attend_splash(q, kk, v, seg, 128, interpret=True)
  np.testing.assert_allclose(splash(q, kk, v, seg), attend(q, kk, v, seg), atol=2e-5, rtol=2e-5)
  g_ref = jax.grad(_loss(attend, seg), argnums=(0, 1, 2))(q, kk, v)
  g = jax.grad(_loss(splash, seg), argnums=(0, 1, 2))(q, kk, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_block_must_divide_the_length():
  q, kk, v, seg = _inputs(1, 48, 2, 2, 8, jnp.float32)
  with pytest.raises(ValueError, match='attention_block=32'):
    attend_blockwise(q, kk, v, seg, 32)


def test_model_logits_and_grads_do_not_depend_on_the_attention():
  cfg = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=8, mlp_dim=64, max_seq_len=64)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, 64)
  segments = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(1), 0.05, (2, 64)), axis=1)

  def loss_and_grads(attention):
    model = Transformer(TransformerConfig(**{**cfg.__dict__, 'attention': attention,
                                             'attention_block': 16}), nnx.Rngs(0))
    loss = lambda m: m(tokens, segments_bt=segments).astype(jnp.float32).std()
    return nnx.value_and_grad(loss)(model)

  (a, ga), (b, gb) = loss_and_grads('xla'), loss_and_grads('blockwise')
  np.testing.assert_allclose(a, b, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)


def test_the_trainer_records_what_auto_picked(tmp_path):
  args, overrides = train.parse_args(['--config', DEFAULT, '--workdir', str(tmp_path), *TINY,
                                      '--config.model.attention=auto',
                                      '--config.model.attention_block=16'])
  run = train.prepare(args, overrides)  # seq_len 32 on the CPU: two key blocks
  assert run.cfg.model.attention == run.model_cfg.attention == 'blockwise'


def test_splash_on_a_sharded_model_matches_xla(devices):
  """Through ``ShardedOps.local``: batch rows over data, heads over tensor, one kernel each."""
  mesh = mesh_lib.make_mesh(dict(data=2, fsdp=1, tensor=4, expert=1, dcn_data=1, dcn_fsdp=1,
                                 dcn_tensor=1, dcn_expert=1), devices)
  rules = sharding.normalize_rules([['batch', 'data'], ['heads', 'tensor'],
                                    ['kv_heads', 'tensor'], ['mlp', 'tensor']])
  ops = sharding.ShardedOps(mesh, rules)
  cfg = TransformerConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=8, num_kv_heads=4,
                          head_dim=128, mlp_dim=64, max_seq_len=128, attention_block=128,
                          splash_interpret=True)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 128), 0, 64)
  segments = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(1), 0.05, (2, 128)), axis=1)

  def loss_and_grads(attention):
    model = Transformer(dataclasses.replace(cfg, attention=attention), nnx.Rngs(0), ops=ops)
    loss = lambda m: m(tokens, segments_bt=segments).astype(jnp.float32).std()
    return jax.jit(lambda m: nnx.value_and_grad(loss)(m))(model)

  (a, ga), (b, gb) = loss_and_grads('xla'), loss_and_grads('splash')
  np.testing.assert_allclose(a, b, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize('kv_rule, refused', [(['kv_heads', 'tensor'], False),
                                              (['kv_heads', None], True)])
def test_splash_needs_heads_and_kv_heads_split_alike(kv_rule, refused):
  """Each device's kernel pairs its query heads with its own key/value heads by position:
  heads split over tensor with key/value heads whole would pair them wrongly, silently."""
  from trainer import config as config_lib, state, validation  # pylint: disable=import-outside-toplevel
  rules = [['batch', 'data'], ['heads', 'tensor'], kv_rule, ['mlp', 'tensor']]
  cfg = config_lib.load(DEFAULT, [*TINY, '--config.model.attention=splash',
                                  f'--config.mesh.logical_axis_rules={rules!r}'])
  params = state.abstract_model(cfg.transformer()).params
  shape = dict(data=2, fsdp=1, tensor=4, expert=1)
  if not refused:
    validation.check_layout(cfg, shape, params)
    return
  with pytest.raises(ValueError, match=r"split 'heads' over \('tensor',\) and 'kv_heads' over "
                                       r"none; split both alike"):
    validation.check_layout(cfg, shape, params)
