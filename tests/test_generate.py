"""Generation: the cached decode path against full recomputation, seeds, the CLI."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.transformer import Transformer, TransformerConfig
from parallelism import mesh as mesh_lib, sharding
from trainer import checkpoint, generate

SMALL = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp_dim=64, max_seq_len=64)
PROMPT = [5, 17, 3, 42, 8]


def _tensor_ops(devices, tensor):
  mesh_cfg = {a: 1 for a in mesh_lib.AXES} | {f'dcn_{a}': 1 for a in mesh_lib.AXES}
  mesh = mesh_lib.make_mesh(mesh_cfg | {'tensor': tensor}, devices[:tensor])
  return sharding.ShardedOps(mesh, generate.rules_for(None))


@pytest.mark.parametrize('kw, tensor', [({}, 2), ({'scan_layers': True}, 1),
                                        ({'tie_embeddings': True, 'num_kv_heads': 4}, 4)])
def test_cached_greedy_decoding_equals_full_recomputation(devices, kw, tensor):
  cfg = TransformerConfig(**{**SMALL, **kw})
  cached = Transformer(cfg, nnx.Rngs(0), _tensor_ops(devices, tensor))
  full = Transformer(cfg, nnx.Rngs(0))  # same parameters, no sharding
  result = generate.generate(cached, PROMPT, 12, return_logits=True)
  assert len(result.tokens) == 12 and len(result.logits) == 12
  # One causal forward over the whole sequence: position p's logits are those of the
  # prefix ending at p, which is what each cached step saw.
  expected = np.asarray(full(jnp.asarray([list(PROMPT) + result.tokens]))[0])
  expected = expected[len(PROMPT) - 1:-1]
  np.testing.assert_allclose(np.asarray(result.logits), expected, rtol=1e-5, atol=1e-5)
  assert result.tokens == [int(t) for t in np.argmax(expected, -1)]


def test_sampling_is_reproducible_with_a_seed():
  model = Transformer(TransformerConfig(**SMALL), nnx.Rngs(0))
  run = lambda seed: generate.generate(model, PROMPT, 16, temperature=1.0, top_k=40,
                                       top_p=0.95, seed=seed).tokens
  first = run(3)
  assert run(3) == first
  assert run(4) != first
  greedy = lambda seed: generate.generate(model, PROMPT, 8, seed=seed).tokens
  assert greedy(3) == greedy(4)  # temperature 0 draws nothing: the seed does not matter


def test_sample_filters():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05, 0.0]]) + 1e-12)
  draws = lambda **kw: {int(generate.sample(logits, jax.random.key(s), 1.0, vocab_limit=5, **kw)[0])
                        for s in range(200)}
  assert draws(top_k=2, top_p=1.0) == {0, 1}
  assert draws(top_k=0, top_p=0.7) == {0, 1}      # 0.5 < 0.7: the second is needed
  assert draws(top_k=0, top_p=0.5) == {0}
  assert int(generate.sample(logits, None, 0.0, 0, 1.0, vocab_limit=5)[0]) == 0
  assert int(generate.sample(-logits, None, 0.0, 0, 1.0, vocab_limit=4)[0]) == 3  # limit


def test_tensor_size_divides_the_model():
  cfg = TransformerConfig(**{**SMALL, 'vocab_size': 264})
  assert generate.tensor_size(cfg, 8) == 2   # kv heads 2
  assert generate.tensor_size(dataclasses.replace(cfg, num_kv_heads=4), 8) == 4
  assert generate.tensor_size(dataclasses.replace(cfg, num_kv_heads=4), 3) == 1


@pytest.fixture(scope='module')
def byte_checkpoint(tmp_path_factory):
  """A tiny random byte-level model written as a params-only checkpoint."""
  cfg = TransformerConfig(**{**SMALL, 'vocab_size': 264, 'num_kv_heads': 4})
  params = nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(1))))
  out = tmp_path_factory.mktemp('gen') / 'tiny'
  checkpoint.write_params(str(out), jax.tree.map(np.asarray, params), dataclasses.asdict(cfg))
  return str(out)


def test_cli_generates_deterministically(byte_checkpoint, capsys):
  argv = ['--checkpoint', byte_checkpoint, '--prompt', 'def f(x):', '--max_new_tokens', '10']
  assert generate.main(argv) == 0
  first = capsys.readouterr()
  assert first.out.startswith('def f(x):')
  assert 'mesh tensor=4 (4 of 8 cpu devices)' in first.err
  assert 'new tokens in' in first.err and 'tokens/s' in first.err
  assert generate.main(argv) == 0
  assert capsys.readouterr().out == first.out


@pytest.mark.parametrize('extra, message', [
    (['--max_new_tokens', '100'], 'exceeds model.max_seq_len=64'),
    (['--top_p', '0'], '--top_p=0.0 is not in (0, 1]'),
    (['--tokenizer', 'missing/tokenizer.json'], 'tokenizer file not found: '),
    (['--mesh.tensor', '3'], 'not divisible'),
])
def test_cli_refusals_exit_2(byte_checkpoint, capsys, extra, message):
  argv = ['--checkpoint', byte_checkpoint, '--prompt', 'x' * 10, '--max_new_tokens', '8'] + extra
  assert generate.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and message in err and '\n' not in err


def test_a_corrupt_checkpoint_exits_1_naming_it_not_the_mesh(byte_checkpoint, tmp_path, capsys):
  from tests.test_checkpoint import corrupt_params  # pylint: disable=import-outside-toplevel
  copy = tmp_path / 'copy'
  shutil.copytree(byte_checkpoint, copy)
  corrupt_params(os.path.join(checkpoint.directory_of(copy), '0'))
  assert generate.main(['--checkpoint', str(copy), '--prompt', 'x', '--max_new_tokens', '2']) == 1
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and '\n' not in err and '--mesh.tensor' not in err, err


def test_evaluate_asks_for_a_config_for_a_parameters_only_checkpoint(byte_checkpoint, capsys):
  from trainer import evaluate  # pylint: disable=import-outside-toplevel
  assert evaluate.main(['--checkpoint', byte_checkpoint]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (f'error: {byte_checkpoint} records no run config (parameters only, e.g. from '
                 'trainer.convert): pass --config'), err


def test_cli_refuses_moe(tmp_path, capsys):
  cfg = TransformerConfig(**{**SMALL, 'vocab_size': 264})
  meta = dataclasses.asdict(cfg)
  meta['moe'] = {**meta['moe'], 'num_experts': 4}
  params = nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(1))))
  checkpoint.write_params(str(tmp_path / 'moe'), jax.tree.map(np.asarray, params), meta)
  assert generate.main(['--checkpoint', str(tmp_path / 'moe'), '--prompt', 'x']) == 2
  assert 'generation supports dense models only' in capsys.readouterr().err
