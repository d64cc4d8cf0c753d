r"""Generates text from a checkpoint with a key/value cache, sharded over the devices.

  python -m trainer.generate --checkpoint PATH (--prompt TEXT | --prompt_file F) \
      [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--seed S] \
      [--tokenizer SPEC] [--mesh.tensor N] [--platform cpu|auto]

PATH is one of our checkpoints: a run's workdir (its newest checkpoint), its
``checkpoints/`` or a step directory, or what ``trainer.convert hf-import``
wrote. The tokenizer is the one the checkpoint came with (trainer/tokenizer.py
``for_checkpoint``) unless ``--tokenizer`` names one. ``--temperature 0`` (the
default) is greedy decoding: deterministic. Otherwise tokens are sampled
(after ``--top_k`` / ``--top_p`` filtering) from a key derived from ``--seed``
and the position, so a seed reproduces a generation.

The model runs on a mesh through the same parallelism layer as training
(``ShardedOps``), with the logical-axis rules of the run that wrote the
checkpoint (``configs/default.py``'s for one without, e.g. imported) less the
sequence axes (``rules_for``): tensor parallelism over heads, key/value heads,
the MLP and the vocabulary, on the largest number of devices that divides them
all, unless ``--mesh.tensor`` says otherwise. Dense layers are
plain einsums: one token at a time gives a collective nothing to overlap with.
The prompt is one call (prefill), then one call per new token; generation
stops at the tokenizer's end-of-document token or after ``--max_new_tokens``.
The text goes to stdout, everything else to stderr. Bad input exits 2 with one
line; MoE checkpoints are refused (dense models only).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging
from flax import nnx

from models.transformer import Transformer, TransformerConfig
from parallelism import cli, mesh as mesh_lib, sharding
from trainer import checkpoint, config as config_lib, files, runtime, tokenizer as tokenizer_lib, validation
from trainer.config import ConfigError, Mesh
from trainer.state import abstract_model, with_shardings

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'configs',
                              'default.py')


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m trainer.generate', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--checkpoint', required=True, help='workdir, checkpoints/ or step directory')
  prompt = p.add_mutually_exclusive_group(required=True)
  prompt.add_argument('--prompt', help='prompt text')
  prompt.add_argument('--prompt_file', help='file holding the prompt (UTF-8)')
  p.add_argument('--max_new_tokens', type=int, default=200)
  p.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
  p.add_argument('--top_k', type=int, default=0, help='keep the k likeliest tokens (0: all)')
  p.add_argument('--top_p', type=float, default=1.0, help='nucleus: smallest set of mass p')
  p.add_argument('--seed', type=int, default=0, help='sampling seed')
  p.add_argument('--tokenizer', default=None,
                 help="'' for bytes, or a tokenizer file/directory (default: the checkpoint's)")
  p.add_argument('--mesh.tensor', dest='tensor', type=int, default=0,
                 help='tensor-parallel devices (0: the most that divide the model)')
  p.add_argument('--platform', choices=('cpu', 'auto'), default='cpu',
                 help='cpu: JAX_PLATFORMS=cpu unless set; auto: let JAX pick (GPU/TPU)')
  return p.parse_args(argv)


def check_args(args) -> None:
  if args.max_new_tokens < 1:
    raise ConfigError(f'--max_new_tokens={args.max_new_tokens} must be at least 1')
  if not (math.isfinite(args.temperature) and args.temperature >= 0):  # NaN samples garbage
    raise ConfigError(f'--temperature={args.temperature} must be finite and >= 0 (0: greedy)')
  if args.top_k < 0:
    raise ConfigError(f'--top_k={args.top_k} must be >= 0 (0: no limit)')
  if not 0 < args.top_p <= 1:
    raise ConfigError(f'--top_p={args.top_p} is not in (0, 1]')
  if args.tensor < 0:
    raise ConfigError(f'--mesh.tensor={args.tensor} must be >= 0 (0: automatic)')


# --- Sampling and the decode loop.

def sample(logits_bv, key, temperature: float, top_k: int, top_p: float, vocab_limit: int):
  """Next token ids ``[b]``: greedy at temperature 0, else filtered sampling.

  Ids at or above ``vocab_limit`` (padding beyond the tokenizer) are never chosen.
  """
  logits = logits_bv.astype(jnp.float32)
  logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k:
    kth = jax.lax.top_k(logits, min(top_k, vocab_limit))[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the likelier tokens
    cutoff = jnp.min(jnp.where(before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class Result:
  tokens: list[int]          # the new tokens (without a final end-of-document token)
  logits: list[Any] | None   # host logits [vocab] that chose each new token, if asked
  prefill_s: float
  decode_s: float
  compile_s: float
  stopped_at_eos: bool

  @property
  def tokens_per_sec(self) -> float:
    """New tokens per second of prefill plus decoding (compilation excluded)."""
    return len(self.tokens) / max(self.prefill_s + self.decode_s, 1e-9)

  @property
  def decode_tokens_per_sec(self) -> float:
    """Tokens per second of the one-token steps alone (the first comes from prefill)."""
    return max(len(self.tokens) - 1, 0) / max(self.decode_s, 1e-9)


def generate(model, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             vocab_limit: int | None = None, return_logits: bool = False) -> Result:
  """Continues ``prompt`` (one sequence) with ``model``'s cached decode path.

  ``model`` is a Transformer whose ops and parameters may be sharded; the
  prompt is one prefill call, then each new token one call. Every call is
  waited for (one sharded computation in flight, as in training).
  """
  cfg = model.cfg
  length = len(prompt) + max_new_tokens
  if not prompt:
    raise ValueError('the prompt is empty: give at least one token')
  if length > cfg.max_seq_len:
    raise ValueError(f'prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = '
                     f'{length} exceeds model.max_seq_len={cfg.max_seq_len}')
  vocab_limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
  graphdef, params = nnx.split(model)
  pick = lambda logits, key: sample(logits, key, temperature, top_k, top_p, vocab_limit)
  base_key = jax.random.key(seed)

  def prefill(params, tokens_bt):
    m = nnx.merge(graphdef, params)
    logits, cache = m.decode(tokens_bt, 0, m.init_cache(1, length))
    last = logits[:, -1]
    return pick(last, jax.random.fold_in(base_key, tokens_bt.shape[1])), last, cache

  def step(params, token_b, index, cache):
    logits, cache = nnx.merge(graphdef, params).decode(token_b[:, None], index, cache)
    return pick(logits[:, 0], jax.random.fold_in(base_key, index + 1)), logits[:, 0], cache

  start = time.perf_counter()
  prompt_bt = jnp.asarray([prompt], jnp.int32)
  prefill_c = jax.jit(prefill).lower(params, prompt_bt).compile()
  compile_s = time.perf_counter() - start

  start = time.perf_counter()
  token, last, cache = prefill_c(params, prompt_bt)
  token_host = int(jax.device_get(token)[0])
  prefill_s = time.perf_counter() - start
  start = time.perf_counter()  # the step is compiled for the layouts prefill returned
  index0 = jnp.int32(len(prompt))
  step_c = jax.jit(step, donate_argnums=(3,)).lower(params, token, index0, cache).compile()
  compile_s += time.perf_counter() - start
  tokens, logits = [], []
  start = time.perf_counter()
  stopped = False
  for i in range(max_new_tokens):
    if return_logits:
      logits.append(np.asarray(jax.device_get(last))[0])
    if eos_id is not None and token_host == eos_id:
      stopped = True
      break
    tokens.append(token_host)
    if i + 1 == max_new_tokens:
      break
    token, last, cache = step_c(params, token, jnp.int32(len(prompt) + i), cache)
    token_host = int(jax.device_get(token)[0])
  return Result(tokens, logits if return_logits else None, prefill_s,
                time.perf_counter() - start, compile_s, stopped)


# --- Loading a checkpoint onto a mesh.

def tensor_size(model_cfg, num_devices: int) -> int:
  """The most devices (a divisor of ``num_devices``) that heads, kv heads, MLP and vocab divide."""
  dims = (model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.mlp_dim, model_cfg.vocab_size)
  return max(t for t in range(1, num_devices + 1)
             if num_devices % t == 0 and all(d % t == 0 for d in dims))


def rules_for(path: str | None):
  """Logical-axis rules for generating from the checkpoint at ``path`` (see above)."""
  run_cfg = checkpoint.peek_meta(path).get('config') if path else None
  table = (run_cfg['mesh']['logical_axis_rules'] if run_cfg
           else config_lib.load(DEFAULT_CONFIG).mesh.logical_axis_rules)
  return sharding.decode_rules(sharding.normalize_rules(table))


def load_model(path: str, model_cfg, tensor: int):
  """The checkpoint's Transformer, parameters sharded over ``tensor`` devices."""
  mesh = mesh_lib.make_mesh(Mesh(data=1, tensor=tensor).sizes(), jax.devices()[:tensor])
  rules = rules_for(path)
  # Plain einsums: one token at a time gives a collective nothing to overlap with.
  ops = sharding.planned_ops(lambda ops: Transformer(model_cfg, nnx.Rngs(0), ops), (1, 1),
                             mesh=mesh, rules=rules,
                             policy=sharding.MatmulPolicy(collective_matmul='never'))
  model = abstract_model(model_cfg, 0, ops)
  abstract, _ = with_shardings(model.params, rules, mesh)
  params = checkpoint.restore_params(path, abstract)
  return nnx.merge(model.graphdef, params), mesh


def _prepare(args):
  """(model config, tokenizer, prompt ids, tokenizer spec); raises ValueError on bad input."""
  check_args(args)
  model_cfg = TransformerConfig.from_config(checkpoint.peek_model_config(args.checkpoint))
  validation.check_model(model_cfg)
  if model_cfg.moe.enabled:
    raise ValueError(f'{args.checkpoint} is a Mixture-of-Experts model (moe.num_experts='
                     f'{model_cfg.moe.num_experts}); generation supports dense models only')
  spec = (args.tokenizer if args.tokenizer is not None
          else tokenizer_lib.for_checkpoint(args.checkpoint))
  tok = tokenizer_lib.load(spec)
  tokenizer_lib.check_vocab(tok, model_cfg.vocab_size,
                            'tokenizer' if args.tokenizer is None else '--tokenizer')
  if args.prompt_file is not None:
    files.check_regular(args.prompt_file, '--prompt_file ')
    with open(args.prompt_file, 'rb') as f:
      raw = f.read()
    text = raw if tok.byte_level else tokenizer_lib.decode_utf8(raw, args.prompt_file)[0]
  else:
    text = args.prompt
  prompt = tok.encode_documents([text])[0][0].tolist()
  if not prompt:
    raise ValueError('the prompt is empty')
  if len(prompt) + args.max_new_tokens > model_cfg.max_seq_len:
    raise ValueError(f'prompt ({len(prompt)} tokens) + --max_new_tokens '
                     f'({args.max_new_tokens}) exceeds model.max_seq_len={model_cfg.max_seq_len}')
  return model_cfg, tok, prompt, spec


def main(argv=None) -> int:
  args = parse_args(argv)
  absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's notes on read-only checkpoints
  err = lambda *a: print(*a, file=sys.stderr, flush=True)
  try:  # before JAX starts: it opens the platforms JAX_PLATFORMS names
    runtime.configure_host(runtime.cpu_device_count(8),
                           platform='cpu' if args.platform == 'cpu' else None)
  except ValueError as e:
    err(f'error: {e}')
    return 2
  try:
    model_cfg, tok, prompt, spec = _prepare(args)
    tensor = args.tensor or tensor_size(model_cfg, jax.device_count())
    if tensor > jax.device_count():
      raise ValueError(f'--mesh.tensor={tensor} exceeds the {jax.device_count()} devices')
    try:
      model, _ = load_model(args.checkpoint, model_cfg, tensor)
    except checkpoint.CheckpointError:  # the checkpoint's fault, not the layout's
      raise
    except ValueError as e:
      raise ValueError(f'--mesh.tensor={tensor}: {e}') from None
  except (ConfigError, ValueError) as e:  # CheckpointError is one: a corrupt one exits 1
    err(f'error: {str(e).strip(chr(34))}')
    return getattr(e, 'exit_status', 2)
  err(f'checkpoint {args.checkpoint}: tokenizer {spec or "bytes"} ({tok.vocab_size} tokens), '
      f'mesh tensor={tensor} ({tensor} of {jax.device_count()} {jax.devices()[0].platform} '
      f'devices), prompt {len(prompt)} tokens')
  result = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=tok.eos_id,
                    vocab_limit=tok.vocab_size)
  text = tok.decode(prompt + result.tokens)
  sys.stdout.write(text + '\n')
  sys.stdout.flush()
  err(f'{len(result.tokens)} new tokens in {result.prefill_s + result.decode_s:.2f} s: '
      f'{result.tokens_per_sec:.1f} tokens/s (prefill of {len(prompt)} tokens '
      f'{result.prefill_s:.3f} s, then {result.decode_tokens_per_sec:.1f} tokens/s; '
      f'compiling {result.compile_s:.1f} s not counted)'
      + ('; stopped at end of document' if result.stopped_at_eos else ''))
  return 0


if __name__ == '__main__':
  cli.run(main)
