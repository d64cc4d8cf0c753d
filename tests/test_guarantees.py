"""What the README promises of outputs, resumes, generation and the train step itself.

Each test here fails when the promise it names is broken on purpose (issue 66, item 9:
every one was checked so, mutation by mutation). They reuse tests/test_checkpoint.py's
tiny runs: one layer, d_model 32, batches of 8 x 32 tokens, a log record every step.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.transformer import Transformer, TransformerConfig
from tests.conftest import ROOT
from tests.test_checkpoint import RUN, _main, _params_equal
from tests.test_cli import DEFAULT, TINY
from tests.test_generate import PROMPT, SMALL
from trainer import checkpoint, generate, loop, tokenizer, train

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_guarantees')

SIX = ['--config.steps=6', '--config.eval_every=2']  # checkpoints at 2, 4 and 6


def _records(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def _scores(records) -> list[tuple]:
  """Each train and eval record's step and numbers, in order (not the run summaries)."""
  return [(r['step'], r.get('loss'), r.get('grad_norm'), r.get('eval_loss'), r.get('eval_bpb'))
          for r in records if 'goodput' not in r]


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """A workdir trained 6 steps straight through (evals at 2, 4, 6)."""
  workdir = tmp_path_factory.mktemp('straight') / 'run'
  assert _main(workdir, *SIX) == 0
  return workdir


# ------------------------------------------------------------------ resuming

def test_a_resume_drops_the_records_after_its_step(straight, tmp_path, capsys):
  """Killed in the middle of its save at step 5 (no commit marker), a run had logged step
  5 and its eval already: resumed from step 4, metrics.jsonl reads as the straight run's."""
  workdir = tmp_path / 'run'
  assert _main(workdir, *SIX, '--config.stop_after=5') == 0
  directory = checkpoint.directory_of(workdir)
  os.remove(os.path.join(directory, '5', checkpoint.COMMIT_MARKER))
  assert [r['step'] for r in _records(workdir)][-3:] == [5, 5, 5]  # train, eval, summary
  capsys.readouterr()
  assert _main(workdir, *SIX) == 0
  assert 'resuming from step 4' in capsys.readouterr().out
  records = _records(workdir)
  assert _scores(records) == _scores(_records(straight))  # every value, exactly
  assert [r['step'] for r in records if 'goodput' in r] == [6]  # step 5's summary went too
  assert len(os.listdir(workdir / 'tb')) == 2  # kept: one event file per run


def test_a_resume_with_another_seed_is_refused(straight, tmp_path, capsys):
  workdir = tmp_path / 'run'
  shutil.copytree(straight, workdir)
  before = (workdir / 'metrics.jsonl').read_text()
  capsys.readouterr()
  assert _main(workdir, '--config.steps=8', '--config.seed=1') == 2
  err = capsys.readouterr().err.strip()
  assert '\n' not in err and 'has checkpoints of another run (seed: 0 in the checkpoint, 1 now' \
      in err, err
  assert (workdir / 'metrics.jsonl').read_text() == before


def test_a_fresh_run_replaces_an_earlier_runs_outputs(straight, tmp_path, capsys):
  """Its checkpoints deleted ("to start over"), the workdir's next run is a new run."""
  workdir = tmp_path / 'run'
  shutil.copytree(straight, workdir)
  shutil.rmtree(checkpoint.directory_of(workdir))
  capsys.readouterr()
  assert _main(workdir, '--config.steps=2', '--config.eval_every=0') == 0
  assert 'replacing the outputs of an earlier run (metrics.jsonl, tb)' in capsys.readouterr().out
  records = _records(workdir)
  assert [r['step'] for r in records] == [1, 2, 2, 2]  # two steps, the final eval, the summary
  assert records[0]['loss'] == _records(straight)[0]['loss']  # the same first step
  assert len(os.listdir(workdir / 'tb')) == 1
  assert json.loads((workdir / 'config.json').read_text())['steps'] == 2


def test_a_checkpoint_that_does_not_fit_the_state_is_left_alone(straight, tmp_path, capsys):
  """Saved under another optimizer (clipping adds a state to the chain): not corrupt, so
  even on_corrupt=previous moves nothing; the run stops naming the checkpoint."""
  workdir = tmp_path / 'run'
  shutil.copytree(straight, workdir)
  directory = checkpoint.directory_of(workdir)
  listing, before = sorted(os.listdir(directory)), (workdir / 'metrics.jsonl').read_text()
  capsys.readouterr()
  assert _main(workdir, '--config.steps=8', '--config.optimizer.grad_clip=0',
               '--config.checkpoint.on_corrupt=previous') == 1
  err = capsys.readouterr().err.strip()
  assert '\n' not in err, err
  assert f"error: {os.path.join(directory, '6')} does not fit this run's state" in err, err
  assert sorted(os.listdir(directory)) == listing == ['2', '4', '6']
  assert (workdir / 'metrics.jsonl').read_text() == before


# Runs trainer.train, sending itself SIGTERM while step argv[1] is dispatched: a
# preemption that lands at a known step, through the real signal handler.
SIGTERM_AT = r'''
import os, signal, sys
from trainer import loop, train
at, run_loop = int(sys.argv[1]), loop._loop

def preempted_loop(run, s, train_step, *rest):
  dispatched = [s.start_step]
  def step(state, batch):
    dispatched[0] += 1
    if dispatched[0] == at:
      os.kill(os.getpid(), signal.SIGTERM)
    return train_step(state, batch)
  return run_loop(run, s, step, *rest)

loop._loop = preempted_loop
sys.exit(train.main(sys.argv[2:]))
'''


def test_sigterm_then_resume_is_bit_exact(straight, tmp_path, capsys):
  workdir = tmp_path / 'run'
  cmd = [sys.executable, '-c', SIGTERM_AT, '3', '--config', DEFAULT, '--workdir', str(workdir),
         *RUN, *SIX]
  proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 143, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert 'stopped by SIGTERM after step 3; checkpoint saved' in proc.stderr, proc.stderr[-2000:]
  assert checkpoint.complete_steps(checkpoint.directory_of(workdir)) == [2, 3]
  capsys.readouterr()
  assert _main(workdir, *SIX) == 0
  assert 'resuming from step 3' in capsys.readouterr().out
  assert _scores(_records(workdir)) == _scores(_records(straight))  # every value, exactly
  assert _params_equal(workdir, straight)


# ---------------------------------------------------------------- generation

def test_generation_stops_at_the_end_of_document_token():
  model = Transformer(TransformerConfig(**SMALL), nnx.Rngs(0))
  free = generate.generate(model, PROMPT, 12)
  assert len(free.tokens) == 12 and not free.stopped_at_eos
  # The first token after the first few that the model had not produced before: its end.
  k = next(i for i, t in enumerate(free.tokens) if i >= 3 and t not in free.tokens[:i])
  stopped = generate.generate(model, PROMPT, 12, eos_id=free.tokens[k])
  assert stopped.stopped_at_eos and stopped.tokens == free.tokens[:k]


def test_the_generate_command_stops_at_the_tokenizers_end_of_document(tmp_path, capsys):
  """A model that always predicts the byte tokenizer's end of document: nothing follows."""
  cfg = TransformerConfig(**{**SMALL, 'vocab_size': 264, 'num_kv_heads': 4})
  params = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(1)))))
  # Every token embeds alike and no block writes to the residual stream, so every position's
  # final state is the same positive vector; the output layer reads only end of document.
  params['embed_vd'][:] = 1.0
  for block in params['blocks'].values():
    block['attn']['o_nhd'][:] = 0.0
    block['mlp']['down_fd'][:] = 0.0
  params['unembed_dv'][:] = 0.0
  params['unembed_dv'][:, tokenizer.EOS_ID] = 1.0
  checkpoint.write_params(str(tmp_path / 'eos'), params, dataclasses.asdict(cfg))
  argv = ['--checkpoint', str(tmp_path / 'eos'), '--prompt', 'def f(x):', '--max_new_tokens', '8']
  assert generate.main(argv) == 0
  out = capsys.readouterr()
  assert out.out == 'def f(x):\n', out.out
  assert '0 new tokens in' in out.err and 'stopped at end of document' in out.err, out.err


# ------------------------------------------------- the train step, by hand

def _documents(directory) -> str:
  """60 short text files (one document each): the held-out batches end documents."""
  os.makedirs(directory)
  rng = np.random.default_rng(0)
  for i in range(60):
    words = ' '.join(rng.choice(['alpha', 'beta', 'gamma', 'delta', 'x = 1', '\n'],
                                int(rng.integers(4, 16))))
    with open(os.path.join(directory, f'{i:02d}.txt'), 'w', encoding='utf-8') as f:
      f.write(f'doc {i}: {words}')
  return os.path.join(directory, '*.txt')


def _lr(step, peak, warmup, steps, end_fraction):
  """The config's schedule by hand: linear warmup from 0, then cosine to end_fraction."""
  if step < warmup:
    return peak * step / warmup
  progress = (step - warmup) / max(steps - warmup, 1)
  return peak * (end_fraction + (1 - end_fraction) * 0.5 * (1 + np.cos(np.pi * progress)))


def _nll(logits_btv, targets_bt):
  """Each target's negative log-likelihood (nats) and log Z, written out."""
  top = jnp.max(logits_btv, axis=-1, keepdims=True)
  log_z = top[..., 0] + jnp.log(jnp.sum(jnp.exp(logits_btv - top), axis=-1))
  picked = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
  return log_z - picked, log_z


def test_three_train_steps_match_an_independent_reference(tmp_path):
  """The trainer's steps (loss, gradient norm, learning rate, parameters) and its eval
  against a reference written out here: the same model forward unsharded, the cross-entropy
  with z-loss, clipping, AdamW with decay on matrices, the warmup-cosine schedule and bits
  per byte by hand. Three steps: the warmup's zero rate, the peak, the cosine's middle."""
  # eps well above the gradients' rounding (an AdamW step divides by |g| + eps), clipping
  # below the first gradients' norm, a z-loss whose gradient shows: each term matters.
  opt = dict(peak=1e-2, warmup=1, b1=0.9, b2=0.95, eps=1e-4, decay=0.1, clip=0.5, z=1e-2,
             end=0.1)
  argv = ['--config', DEFAULT, '--workdir', str(tmp_path / 'run'), *TINY,
          f'--config.data.path={_documents(tmp_path / "docs")}', '--config.data.eval_fraction=0.3',
          '--config.steps=3', '--config.log_every=1', '--config.eval_every=0',
          '--config.checkpoint.every=3', f'--config.optimizer.learning_rate={opt["peak"]}',
          f'--config.optimizer.warmup_steps={opt["warmup"]}', '--config.optimizer.schedule=cosine',
          f'--config.optimizer.end_lr_fraction={opt["end"]}', f'--config.optimizer.b1={opt["b1"]}',
          f'--config.optimizer.b2={opt["b2"]}', f'--config.optimizer.eps={opt["eps"]}',
          f'--config.optimizer.weight_decay={opt["decay"]}',
          f'--config.optimizer.grad_clip={opt["clip"]}', f'--config.optimizer.z_loss={opt["z"]}']
  # What the trainer starts from: its initial parameters and its batches.
  run = train.prepare(*train.parse_args(argv))
  s = loop.setup(run)
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(s.state.params))
  host = lambda b: {k: np.asarray(v) for k, v in b.items()}
  batches = [host(s.get_batch(k)) for k in range(3)]
  evals = [host(b) for b in s.eval_batches]
  s.get_batch.close()
  assert train.main(argv) == 0
  got = _records(tmp_path / 'run')
  trained = checkpoint.read_params(tmp_path / 'run')[1]

  graphdef, state = nnx.split(Transformer(run.model_cfg, nnx.Rngs(0)))  # plain einsums

  def forward(p, batch):
    nnx.replace_by_pure_dict(state, p)
    return nnx.merge(graphdef, state)(batch['inputs'], batch['positions'], batch['segments'])

  def loss(p, batch):
    nll, log_z = _nll(forward(p, batch), batch['targets'])
    return jnp.mean(nll) + opt['z'] * jnp.mean(log_z ** 2), jnp.mean(nll)

  grad = jax.jit(jax.grad(loss, has_aux=True))
  mu = jax.tree.map(np.zeros_like, params)
  nu = jax.tree.map(np.zeros_like, params)
  want, clipped = [], 0
  for k, batch in enumerate(batches):
    g, ce = grad(params, batch)
    g = jax.tree.map(lambda x: np.asarray(x, np.float64), g)
    norm = np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(g)))
    if norm > opt['clip']:
      g, clipped = jax.tree.map(lambda x: x * opt['clip'] / norm, g), clipped + 1
    lr = _lr(k, opt['peak'], opt['warmup'], 3, opt['end'])
    mu = jax.tree.map(lambda m, x: opt['b1'] * m + (1 - opt['b1']) * x, mu, g)
    nu = jax.tree.map(lambda v, x: opt['b2'] * v + (1 - opt['b2']) * x ** 2, nu, g)

    def update(p, m, v):
      step = (m / (1 - opt['b1'] ** (k + 1))) / (np.sqrt(v / (1 - opt['b2'] ** (k + 1)))
                                                  + opt['eps'])
      if p.ndim >= 2:  # matrices decay; norm scales do not
        step = step + opt['decay'] * p
      return (p - lr * step).astype(np.float32)

    params = jax.tree.map(update, params, mu, nu)
    want.append({'step': k + 1, 'loss': float(ce), 'grad_norm': norm, 'learning_rate': lr})
  assert clipped >= 1  # clipping is exercised

  nats = byte_nats = tokens = byte_count = 0.0
  for batch in evals:
    nll = np.asarray(_nll(forward(params, batch), batch['targets'])[0], np.float64)
    is_byte = batch['targets'] < 256  # end of document is a token, not a byte
    nats, tokens = nats + nll.sum(), tokens + nll.size
    byte_nats, byte_count = byte_nats + nll[is_byte].sum(), byte_count + is_byte.sum()
  assert byte_count < tokens  # the held-out batches hold ends of documents

  steps = [r for r in got if 'loss' in r]
  assert [r['step'] for r in steps] == [1, 2, 3]
  for r, w in zip(steps, want):
    for key in ('loss', 'grad_norm', 'learning_rate'):
      assert r[key] == pytest.approx(w[key], rel=1e-5, abs=1e-12), (r['step'], key)
  [ev] = [r for r in got if 'eval_loss' in r]
  assert ev['eval_loss'] == pytest.approx(nats / tokens, rel=1e-5)
  assert ev['eval_bpb'] == pytest.approx(byte_nats / byte_count / np.log(2), rel=1e-5)
  want_params, got_params = checkpoint.flatten(params), checkpoint.flatten(trained)
  assert sorted(want_params) == sorted(got_params)
  for name, value in want_params.items():
    np.testing.assert_allclose(got_params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
