r"""Converts Llama weights between Hugging Face safetensors and ringtrain.

  python -m trainer.convert hf-import --hf_dir DIR --out_dir OUT \
      [--scan_layers] [--check] [--dtype float32]
  python -m trainer.convert hf-export --checkpoint PATH --out_dir DIR

``hf-import`` reads a Llama-architecture Hugging Face checkpoint (``config.json``
and ``*.safetensors``, single or sharded with ``model.safetensors.index.json``)
without pickle, maps it onto :class:`models.transformer.Transformer` and writes
a params-only checkpoint that ``configs/finetune.py:OUT`` fine-tunes; the
tokenizer files the directory has (``tokenizer.json``, ``tokenizer.model``,
``tokenizer_config.json``) are copied to OUT, where ``trainer.generate`` and
``configs/finetune.py`` find them (trainer/tokenizer.py). ``--check``
first runs the Hugging Face model (transformers, CPU, fp32) and ours on the same
random tokens and fails (exit 1, nothing written) if the logits differ by more
than 1e-4. ``hf-export`` writes our params back as an fp32 Hugging Face Llama
(``config.json`` + ``model.safetensors``) that transformers loads.

Bad input exits with status 2 and a one-line ``error:`` message, before
anything is written. Everything runs on CPU (JAX_PLATFORMS defaults to cpu).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from models.transformer import Transformer, TransformerConfig
from trainer import checkpoint, files, tokenizer, validation
from trainer.hints import install_hint

CHECK_TOLERANCE = 1e-4
INDEX_FILE = 'model.safetensors.index.json'
PICKLE_PATTERNS = ('pytorch_model*.bin', '*.pt', '*.pth', '*.ckpt')
RAW_DTYPES = {'BF16': ml_dtypes.bfloat16}  # safetensors dtypes numpy lacks
IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # buffers some old checkpoints saved
DTYPES = ('float32', 'bfloat16', 'float16')


class ConvertError(ValueError):
  """Bad input: reported as one line, exit status 2."""


# --- Hugging Face config <-> TransformerConfig -------------------------------


def check_hf_files(hf_dir: str, names=()) -> None:
  """Every file hf-import reads from ``hf_dir`` (and ``names`` in it) is a regular file
  inside it, symlinks followed: a FIFO would block the read, a link out of the directory
  would copy what it points at (a private key) into the output."""
  if not os.path.isdir(hf_dir):
    raise ConvertError(f'--hf_dir {hf_dir} is not a directory')
  read = ('config.json', INDEX_FILE, 'tokenizer_config.json', *tokenizer.FILES)
  paths = [os.path.join(hf_dir, n) for n in (*read, *names)]
  paths += glob.glob(os.path.join(glob.escape(hf_dir), '*.safetensors'))
  for path in paths:
    if os.path.lexists(path):
      try:
        files.check_inside(hf_dir, path, '--hf_dir: ')
        files.check_regular(path, '--hf_dir: ')
      except ValueError as e:
        raise ConvertError(str(e)) from None


def read_hf_config(hf_dir: str) -> dict:
  """Loads ``hf_dir/config.json``."""
  check_hf_files(hf_dir)
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.isfile(path):
    raise ConvertError(f'{path} not found: a Hugging Face checkpoint directory '
                       'needs config.json next to its *.safetensors')
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ConvertError(f'cannot read {path}: {e}') from None


def _rope_theta(hf: dict) -> float:
  """The rotary base; refuses any rope scaling (llama3, linear, yarn, ...)."""
  theta = hf.get('rope_theta')
  for key in ('rope_parameters', 'rope_scaling'):
    params = hf.get(key)
    if params is None:
      continue
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
      raise ConvertError(f'{key}={params!r} is not supported (expected one flat dict)')
    kind = params.get('rope_type', params.get('type'))
    if kind not in (None, 'default'):
      raise ConvertError(f'{key} type {kind!r} is not supported: only unscaled rotary '
                         "embeddings (rope type 'default') convert exactly")
    if params.get('partial_rotary_factor', 1.0) != 1.0:
      raise ConvertError(f'{key}.partial_rotary_factor='
                         f'{params["partial_rotary_factor"]} is not supported')
    theta = params.get('rope_theta', theta)
  return float(10_000.0 if theta is None else theta)


def _check_architecture(hf: dict) -> None:
  archs = hf.get('architectures') or []
  unsupported = [a for a in archs if a not in ('LlamaForCausalLM', 'LlamaModel')]
  if unsupported or hf.get('model_type', 'llama') != 'llama':
    raise ConvertError(f'architecture {unsupported or archs} (model_type='
                       f'{hf.get("model_type")!r}) is not supported: only Llama '
                       '(LlamaForCausalLM / LlamaModel) checkpoints convert')
  act = hf.get('hidden_act', 'silu')
  if act != 'silu':
    raise ConvertError(f'hidden_act={act!r} is not supported: only silu (SwiGLU)')
  for key in ('attention_bias', 'mlp_bias'):
    if hf.get(key):
      raise ConvertError(f'{key}=true is not supported: our model has no biases')


def model_config_from_hf(hf: dict, scan_layers: bool = False,
                         param_dtype: str = 'float32') -> TransformerConfig:
  """Maps a Hugging Face Llama config.json onto a TransformerConfig."""
  _check_architecture(hf)
  missing = [k for k in ('vocab_size', 'hidden_size', 'num_hidden_layers',
                         'num_attention_heads', 'intermediate_size') if hf.get(k) is None]
  if missing:
    raise ConvertError(f'config.json lacks {", ".join(missing)}')
  try:
    heads = int(hf['num_attention_heads'])
    head_dim = int(hf.get('head_dim') or hf['hidden_size'] // max(heads, 1))
    cfg = TransformerConfig(
        vocab_size=int(hf['vocab_size']), d_model=int(hf['hidden_size']),
        num_layers=int(hf['num_hidden_layers']), num_heads=heads,
        num_kv_heads=int(hf.get('num_key_value_heads') or heads), head_dim=head_dim,
        mlp_dim=int(hf['intermediate_size']),
        max_seq_len=int(hf.get('max_position_embeddings', 2048)),
        rope_theta=_rope_theta(hf), norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
        tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
        param_dtype=param_dtype, scan_layers=scan_layers)
  except (TypeError, ValueError, OverflowError) as e:
    raise ConvertError(f'config.json has a size that is not a number ({e})') from None
  if head_dim % 2:
    raise ConvertError(f'head_dim={head_dim} must be even for rotary embeddings')
  try:
    validation.check_model(cfg)
  except ValueError as e:
    raise ConvertError(f'config.json: {e}') from None
  return cfg


def hf_config_from_model(cfg: TransformerConfig) -> dict:
  """The config.json of an fp32 Hugging Face LlamaForCausalLM equal to ``cfg``."""
  return {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
      'vocab_size': cfg.vocab_size, 'hidden_size': cfg.d_model,
      'num_hidden_layers': cfg.num_layers, 'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads, 'head_dim': cfg.head_dim,
      'intermediate_size': cfg.mlp_dim, 'max_position_embeddings': cfg.max_seq_len,
      'rms_norm_eps': cfg.norm_eps, 'rope_theta': cfg.rope_theta,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},
      'tie_word_embeddings': cfg.tie_embeddings, 'hidden_act': 'silu',
      'attention_bias': False, 'mlp_bias': False, 'dtype': 'float32',
  }


# --- Reading safetensors without pickle --------------------------------------


def weight_files(hf_dir: str) -> list[str]:
  """The safetensors files holding the weights; refuses pickle-only dirs."""
  index = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index):
    try:
      with open(index, encoding='utf-8') as f:
        names = sorted(set(json.load(f)['weight_map'].values()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
      raise ConvertError(f'cannot read the weight_map of {index}: {e!r}') from None
    outside = [n for n in names if not _is_inside(n)]
    if outside:
      raise ConvertError(f'{index} names a shard outside {hf_dir}: {outside[0]!r} (only '
                         'file names relative to that directory, without "..", are read)')
    absent = [n for n in names if not os.path.lexists(os.path.join(hf_dir, n))]
    if absent:
      raise ConvertError(f'{index} names shards that are not there: {", ".join(absent)}')
    check_hf_files(hf_dir, names)
    return [os.path.join(hf_dir, n) for n in names]
  files = sorted(glob.glob(os.path.join(hf_dir, '*.safetensors')))
  if files:
    return files
  pickles = sorted({os.path.basename(p) for pat in PICKLE_PATTERNS
                    for p in glob.glob(os.path.join(hf_dir, pat))})
  if pickles:
    raise ConvertError(
        f'{hf_dir} has only PyTorch pickle weights ({", ".join(pickles)}); loading pickle '
        'files could execute arbitrary code, so only *.safetensors are read. Convert them '
        'first, in an environment you trust: python -c "from transformers import '
        f"AutoModelForCausalLM as M; M.from_pretrained('{hf_dir}')"
        ".save_pretrained('NEW_DIR', safe_serialization=True)\"")
  raise ConvertError(f'{hf_dir} has no *.safetensors weights')


def _is_inside(name) -> bool:
  """Whether shard name ``name`` stays in its directory (relative, no way up)."""
  if not isinstance(name, str) or not name or os.path.isabs(name):
    return False
  return os.path.normpath(name).split(os.sep)[0] != os.pardir


def _read_raw(path: str, names: list[str]) -> dict[str, np.ndarray]:
  """Reads tensors whose dtype numpy lacks (bf16) from the file's raw bytes."""
  with open(path, 'rb') as f:
    size = int.from_bytes(f.read(8), 'little')
    header = json.loads(f.read(size))
  data = np.memmap(path, dtype=np.uint8, mode='r', offset=8 + size)
  out = {}
  for name in names:
    info = header[name]
    start, end = info['data_offsets']
    raw = data[start:end].view(RAW_DTYPES[info['dtype']]).reshape(info['shape'])
    out[name] = raw.astype(np.float32)
  return out


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of one safetensors file as float32 numpy arrays."""
  try:
    with safe_open(path, framework='np') as f:
      dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
      bad = {n: dt for n, dt in dtypes.items() if not dt.startswith(('F', 'BF'))}
      if bad:
        raise ConvertError(f'{path}: tensors that are not floating point: {bad}')
      out = {name: f.get_tensor(name).astype(np.float32)
             for name, dt in dtypes.items() if dt not in RAW_DTYPES}
  except ConvertError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # SafetensorError, OSError
    raise ConvertError(f'cannot read {path}: {str(e).splitlines()[0]}') from None
  out.update(_read_raw(path, [n for n, dt in dtypes.items() if dt in RAW_DTYPES]))
  return out


def read_hf_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every weight of the checkpoint (float32), keyed by its Hugging Face name."""
  tensors = {}
  for path in weight_files(hf_dir):
    for name, value in read_safetensors(path).items():
      if name in tensors:
        raise ConvertError(f'tensor {name} appears in more than one file of {hf_dir}')
      if not name.endswith(IGNORED_SUFFIXES):
        tensors[name] = value
  return tensors


# --- Hugging Face tensors <-> our params --------------------------------------


def _hf_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """Hugging Face name (without the 'model.' prefix) -> expected shape."""
  d, n, k, h, f, v = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.mlp_dim, cfg.vocab_size)
  block = {'self_attn.q_proj.weight': (n * h, d), 'self_attn.k_proj.weight': (k * h, d),
           'self_attn.v_proj.weight': (k * h, d), 'self_attn.o_proj.weight': (d, n * h),
           'mlp.gate_proj.weight': (f, d), 'mlp.up_proj.weight': (f, d),
           'mlp.down_proj.weight': (d, f), 'input_layernorm.weight': (d,),
           'post_attention_layernorm.weight': (d,)}
  shapes = {'embed_tokens.weight': (v, d), 'norm.weight': (d,)}
  for i in range(cfg.num_layers):
    shapes.update({f'layers.{i}.{name}': s for name, s in block.items()})
  return shapes


def _strip_prefix(tensors: dict, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """Accepts LlamaForCausalLM ('model.' prefix) or LlamaModel key names.

  Moves the arrays out of ``tensors`` (which ends empty), so that each is freed
  as soon as it is converted.
  """
  out = {}
  for name in list(tensors):
    key = name[len('model.'):] if name.startswith('model.') else name
    if key in out:
      raise ConvertError(f'both {key} and model.{key} are in the checkpoint')
    out[key] = tensors.pop(name)
  _check_layer_count(out, cfg)
  expected = set(_hf_shapes(cfg)) | ({'lm_head.weight'} if not cfg.tie_embeddings else set())
  missing, extra = sorted(expected - set(out)), sorted(set(out) - expected)
  if missing:
    raise ConvertError(f'{len(missing)} Llama weights missing, e.g. {missing[:3]}'
                       + (' (untied embeddings need lm_head.weight)'
                          if 'lm_head.weight' in missing else ''))
  if extra == ['lm_head.weight']:  # tied checkpoints sometimes store the copy
    if not np.array_equal(out.pop('lm_head.weight'), out['embed_tokens.weight']):
      raise ConvertError('tie_word_embeddings=true but lm_head.weight differs from '
                         'embed_tokens.weight')
    extra = []
  if extra:
    raise ConvertError(f'{len(extra)} unexpected tensors, e.g. {extra[:3]}: only '
                       'bias-free Llama weights are supported')
  return out


def _check_layer_count(tensors: dict, cfg: TransformerConfig) -> None:
  """config.json's layer count against the layers the weights hold, before expecting any."""
  layers = {int(m.group(1)) for m in map(re.compile(r'layers\.(\d+)\.').match, tensors) if m}
  if len(layers) != cfg.num_layers or max(layers, default=-1) != cfg.num_layers - 1:
    held = (f'layers {min(layers)}..{max(layers)} ({len(layers)} distinct)' if layers
            else 'no layers')
    raise ConvertError(f'config.json says num_hidden_layers={cfg.num_layers}, but the '
                       f'weights hold {held}')


def _check_hf_shapes(tensors: dict, cfg: TransformerConfig) -> None:
  shapes = dict(_hf_shapes(cfg), **{'lm_head.weight': (cfg.vocab_size, cfg.d_model)})
  for name, shape in shapes.items():
    if name in tensors and tuple(tensors[name].shape) != shape:
      raise ConvertError(f'{name} has shape {tuple(tensors[name].shape)}, but '
                         f'config.json implies {shape}')


def _block_to_ours(w: dict[str, np.ndarray], cfg: TransformerConfig) -> dict:
  """One layer: Hugging Face [out, in] Linear weights -> our einsum layouts."""
  d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  c = np.ascontiguousarray
  return {
      'attn': {'q_dnh': c(w['self_attn.q_proj.weight'].T.reshape(d, n, h)),
               'k_dkh': c(w['self_attn.k_proj.weight'].T.reshape(d, k, h)),
               'v_dkh': c(w['self_attn.v_proj.weight'].T.reshape(d, k, h)),
               'o_nhd': c(w['self_attn.o_proj.weight'].T.reshape(n, h, d))},
      'mlp': {'gate_df': c(w['mlp.gate_proj.weight'].T),
              'up_df': c(w['mlp.up_proj.weight'].T),
              'down_fd': c(w['mlp.down_proj.weight'].T)},
      'attn_norm': {'scale': w['input_layernorm.weight']},
      'mlp_norm': {'scale': w['post_attention_layernorm.weight']},
  }


def _block_to_hf(block: dict, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """The inverse of :func:`_block_to_ours`."""
  d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  a, m = block['attn'], block['mlp']
  return {
      'self_attn.q_proj.weight': a['q_dnh'].reshape(d, n * h).T,
      'self_attn.k_proj.weight': a['k_dkh'].reshape(d, k * h).T,
      'self_attn.v_proj.weight': a['v_dkh'].reshape(d, k * h).T,
      'self_attn.o_proj.weight': a['o_nhd'].reshape(n * h, d).T,
      'mlp.gate_proj.weight': m['gate_df'].T, 'mlp.up_proj.weight': m['up_df'].T,
      'mlp.down_proj.weight': m['down_fd'].T,
      'input_layernorm.weight': block['attn_norm']['scale'],
      'post_attention_layernorm.weight': block['mlp_norm']['scale'],
  }


def hf_to_params(tensors: dict[str, np.ndarray], cfg: TransformerConfig) -> dict:
  """Hugging Face Llama tensors -> our nested params (the model's pure dict).

  Consumes ``tensors``: the arrays move into the result (pass a copy to keep it).
  """
  w = _strip_prefix(tensors, cfg)
  _check_hf_shapes(w, cfg)
  blocks = []
  for i in range(cfg.num_layers):
    prefix = f'layers.{i}.'
    names = [name for name in w if name.startswith(prefix)]
    blocks.append(_block_to_ours({n[len(prefix):]: w.pop(n) for n in names}, cfg))
  params = {'embed_vd': w['embed_tokens.weight'], 'final_norm': {'scale': w['norm.weight']}}
  if cfg.scan_layers:
    params['blocks'] = jax.tree.map(lambda *xs: np.stack(xs), *blocks)
  else:
    params['blocks'] = dict(enumerate(blocks))
  if not cfg.tie_embeddings:
    params['unembed_dv'] = np.ascontiguousarray(w['lm_head.weight'].T)
  return params


def params_to_hf(params: dict, cfg: TransformerConfig) -> dict[str, np.ndarray]:
  """Our params -> LlamaForCausalLM tensors (float32, contiguous)."""
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  out = {'model.embed_tokens.weight': params['embed_vd'],
         'model.norm.weight': params['final_norm']['scale']}
  for i in range(cfg.num_layers):
    block = (jax.tree.map(lambda x, i=i: x[i], params['blocks']) if cfg.scan_layers
             else params['blocks'][i])
    for name, value in _block_to_hf(block, cfg).items():
      out[f'model.layers.{i}.{name}'] = value
  if not cfg.tie_embeddings:
    out['lm_head.weight'] = params['unembed_dv'].T
  return {name: np.ascontiguousarray(value) for name, value in out.items()}


# --- Our model -----------------------------------------------------------------


def check_structure(params: dict, cfg: TransformerConfig) -> None:
  """Raises ConvertError unless ``params`` has the model's tree, shapes and dtypes."""
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  want = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)),
                      nnx.to_pure_dict(abstract))
  got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), params)
  if jax.tree.structure(want) != jax.tree.structure(got):
    raise ConvertError(f'params tree {jax.tree.structure(got)} is not the model\'s '
                       f'{jax.tree.structure(want)}')
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want),
                          jax.tree.leaves(got)):
    if w != g:
      raise ConvertError(f'params{jax.tree_util.keystr(path)} is {g}, the model wants {w}')


def build_model(params: dict, cfg: TransformerConfig) -> Transformer:
  """Our model (single device, no mesh) holding ``params``, without a random init."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  return nnx.merge(graphdef, state)


def import_hf(hf_dir: str, scan_layers: bool = False) -> tuple[TransformerConfig, dict]:
  """Reads and converts a Hugging Face Llama checkpoint, in float32, in memory."""
  cfg = model_config_from_hf(read_hf_config(hf_dir), scan_layers)
  files = weight_files(hf_dir)
  print(f'reading {len(files)} safetensors file(s) from {hf_dir}', flush=True)
  tensors = read_hf_tensors(hf_dir)
  print(f'read {len(tensors)} tensors; converting to {cfg.num_layers} layers, '
        f'd_model={cfg.d_model}, vocab_size={cfg.vocab_size}', flush=True)
  params = hf_to_params(tensors, cfg)
  check_structure(params, cfg)
  return cfg, params


# --- The logits check (transformers, test-only dependency) ---------------------


def _import_torch_transformers():
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConvertError(f'--check needs torch and transformers ({e}): '
                       f'{install_hint("hf")}') from None
  transformers.logging.set_verbosity_error()
  return torch, transformers


def hf_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
  """Logits of transformers' LlamaForCausalLM (CPU, fp32) for ``tokens``."""
  torch, transformers = _import_torch_transformers()
  model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  model.eval()
  with torch.no_grad():
    return model(torch.from_numpy(tokens)).logits.float().numpy()


def our_logits(params: dict, cfg: TransformerConfig, tokens: np.ndarray) -> np.ndarray:
  """Our model's fp32 logits for ``tokens``."""
  cfg = dataclasses.replace(cfg, dtype='float32', param_dtype='float32')
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  with jax.default_matmul_precision('highest'):
    return np.asarray(build_model(params, cfg)(jnp.asarray(tokens)))


def check_tokens(cfg: TransformerConfig, seed: int = 0) -> np.ndarray:
  length = min(32, cfg.max_seq_len)
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, length))


def logit_difference(hf_dir: str, params: dict, cfg: TransformerConfig) -> float:
  """max |our logits - transformers' logits| on seeded random tokens."""
  tokens = check_tokens(cfg)
  want = hf_logits(hf_dir, tokens)
  return float(np.max(np.abs(our_logits(params, cfg, tokens) - want)))


# --- Commands --------------------------------------------------------------------


def _check_out_dir(out_dir: str) -> None:
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise ConvertError(f'--out_dir {out_dir} already exists and is not empty: '
                       'choose a new one or remove it')


def cmd_import(args) -> int:
  """hf-import: returns the exit status."""
  _check_out_dir(args.out_dir)
  cfg, params = import_hf(args.hf_dir, args.scan_layers)
  if args.check:
    diff = logit_difference(args.hf_dir, params, cfg)
    print(f'max |logit difference| = {diff:.3g}', flush=True)
    if not diff <= CHECK_TOLERANCE:
      print(f'check failed: logits differ by more than {CHECK_TOLERANCE}; '
            f'nothing written to {args.out_dir}', file=sys.stderr)
      return 1
  cfg = dataclasses.replace(cfg, param_dtype=args.dtype)
  params = jax.tree.map(lambda x: np.asarray(x, jnp.dtype(args.dtype)), params)
  print(f'writing {args.dtype} params to {args.out_dir}', flush=True)
  path = checkpoint.write_params(args.out_dir, params, dataclasses.asdict(cfg),
                                 source=f'hf:{os.path.abspath(args.hf_dir)}')
  copied = copy_tokenizer(args.hf_dir, args.out_dir)
  if copied:
    print(f'copied the tokenizer ({", ".join(copied)}) to {args.out_dir}')
  print(f'wrote {path}\nfine-tune it with:\n  python -m trainer.train --config '
        f'configs/finetune.py:{args.out_dir} --workdir runs/finetune')
  return 0


def copy_tokenizer(hf_dir: str, out_dir: str) -> list[str]:
  """Copies the tokenizer files of ``hf_dir`` next to the checkpoint; returns their names."""
  names = [n for n in tokenizer.FILES if os.path.isfile(os.path.join(hf_dir, n))]
  if names and os.path.isfile(os.path.join(hf_dir, 'tokenizer_config.json')):
    names.append('tokenizer_config.json')  # names the end-of-document token
  for name in names:  # hf-import checked them before writing anything; hf-export's, here
    try:
      files.check_inside(hf_dir, os.path.join(hf_dir, name), '')
    except ValueError as e:
      raise ConvertError(str(e)) from None
    shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out_dir, name))
  return names


def export_hf(params: dict, cfg: TransformerConfig, out_dir: str,
              eos_id: int | None = None) -> None:
  """Writes ``config.json`` and ``model.safetensors`` (fp32) to ``out_dir``.

  ``eos_id``: the tokenizer's end-of-document token, which Hugging Face's ``generate``
  stops at; written as None when there is none (Llama's default, 2, would be a guess).
  BOS is written as None: the model has no token it must start with.
  """
  check_structure(params, cfg)
  tensors = params_to_hf(params, cfg)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump({**hf_config_from_model(cfg), 'bos_token_id': None, 'eos_token_id': eos_id},
              f, indent=2)
    f.write('\n')
  save_file(tensors, os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})


def cmd_export(args) -> int:
  """hf-export: returns the exit status."""
  _check_out_dir(args.out_dir)
  if not os.path.exists(args.checkpoint):
    raise ConvertError(f'--checkpoint {args.checkpoint} does not exist')
  try:
    model_config, params = checkpoint.read_params(args.checkpoint)
    cfg = TransformerConfig.from_config(model_config)
    validation.check_model(cfg)
    if cfg.moe.enabled:
      raise ValueError('a Mixture-of-Experts model has no Llama equivalent to export to')
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ConvertError(f'cannot read params from {args.checkpoint}: '
                       f'{str(e).splitlines()[0] if str(e) else repr(e)}') from None
  try:  # a run's (bytes unless it names one), or the file hf-import copied; else none
    spec = tokenizer.for_checkpoint(args.checkpoint)
    trained = 'config' in checkpoint.peek_meta(args.checkpoint)
    tok = tokenizer.load(spec) if spec or trained else None
  except (OSError, ValueError) as e:
    raise ConvertError(f'{args.checkpoint}: its tokenizer: {e}') from None
  eos_id = tok and tok.eos_id
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  check_structure(params, dataclasses.replace(cfg, param_dtype='float32'))
  print(f'writing {len(jax.tree.leaves(params))} tensors as a Hugging Face Llama '
        f'(fp32) to {args.out_dir}', flush=True)
  export_hf(params, dataclasses.replace(cfg, param_dtype='float32'), args.out_dir, eos_id)
  path = tokenizer.resolve(spec) if spec else ''
  copied = (copy_tokenizer(os.path.dirname(path), args.out_dir)
            if os.path.basename(path) in tokenizer.FILES else [])
  print(f'wrote {args.out_dir}/config.json and model.safetensors (eos_token_id {eos_id}: '
        + (f'tokenizer {spec or "bytes"}' if tok else 'no tokenizer known')
        + (f'; copied {", ".join(copied)})' if copied else ')'))
  return 0


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m trainer.convert', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest='command', required=True)
  imp = sub.add_parser('hf-import', help='Hugging Face Llama -> params checkpoint')
  imp.add_argument('--hf_dir', required=True, help='config.json + *.safetensors')
  imp.add_argument('--out_dir', required=True, help='where to write the checkpoint')
  imp.add_argument('--scan_layers', action='store_true',
                   help='stack the blocks on a layers axis (model.scan_layers=True)')
  imp.add_argument('--check', action='store_true',
                   help='compare logits with transformers first (needs .[hf])')
  imp.add_argument('--dtype', default='float32', choices=DTYPES,
                   help='dtype of the written params')
  exp = sub.add_parser('hf-export', help='params checkpoint -> Hugging Face Llama')
  exp.add_argument('--checkpoint', required=True,
                   help='hf-import output, a run workdir (its latest checkpoint) or a step dir')
  exp.add_argument('--out_dir', required=True, help='where to write the HF model')
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if not os.environ.get('JAX_PLATFORMS'):
    jax.config.update('jax_platforms', 'cpu')  # conversion and check need no accelerator
  try:
    return cmd_import(args) if args.command == 'hf-import' else cmd_export(args)
  except ConvertError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
