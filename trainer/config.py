"""The run config: typed, frozen sections, loaded once at the entry point.

A config file is a Python module with ``get_config()`` returning an
``ml_collections.ConfigDict`` (``path.py``, or ``path.py:arg`` to pass an
argument). :func:`load` turns it, with ``--config.a.b=value`` overrides, into a
:class:`Config` of the frozen dataclasses below: the only form of the config
below the entry points. Every key is a field whose metadata holds its one-line
meaning; ``--help`` lists them (:func:`help_text`) and configs/README.md is
generated from them (``python -m trainer.config --markdown``). Keys a config
file leaves out take the defaults here, which are configs/default.py's.
:meth:`Config.validate` checks the values (trainer/validation.py). Every problem
raises :class:`ConfigError` with a one-line message; the entry point turns it
into exit status 2.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import textwrap
import typing
from typing import Any, Literal, Sequence

from trainer import hints as hints_lib


class ConfigError(ValueError):
  """Bad user input: reported as one line, exit status 2."""


def _key(default: Any, meaning: str) -> Any:
  """A config key: its default and the one-line meaning ``--help`` shows."""
  return dataclasses.field(default=default, metadata={'help': meaning})


def _group(cls: type) -> Any:
  return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class Model:
  """The Transformer (models/transformer.py; attention: models/attention.py)."""
  vocab_size: int = _key(264, 'output classes; byte-level data needs at least 257')
  d_model: int = _key(128, 'embedding width (`embed`)')
  num_layers: int = _key(4, 'Transformer blocks (`layers`)')
  num_heads: int = _key(4, 'query heads (`heads`)')
  num_kv_heads: int = _key(4, 'key/value heads (`kv_heads`); grouped-query when below '
                              '`num_heads`')
  head_dim: int = _key(32, 'per-head width (`head_dim`)')
  mlp_dim: int = _key(512, 'SwiGLU hidden width (`mlp`)')
  max_seq_len: int = _key(1024, 'longest sequence accepted')
  rope_theta: float = _key(10_000.0, 'rotary embedding base')
  norm_eps: float = _key(1e-6, 'RMSNorm epsilon')
  tie_embeddings: bool = _key(False, 'the output layer reuses the input embedding')
  dtype: str = _key('float32', 'compute dtype: float32 | bfloat16 | float16 (bfloat16 on '
                               'accelerators; a CPU has no native bf16)')
  param_dtype: str = _key('float32', 'parameter / master-weight dtype')
  scan_layers: bool = _key(False, '`jax.lax.scan` over layers (compile time of deep models)')
  scan_unroll: int = _key(1, 'layers per iteration of that scan (2: the compiler can gather '
                             'the next layer\'s weights during this one\'s compute)')
  cast_in_loop: bool = _key(False, "cast each scanned layer's weights to `dtype` inside the "
                                   'scan (an optimization barrier): the compiler otherwise '
                                   "casts all layers' weights before it and keeps that copy "
                                   'through the forward and backward passes; it also stops '
                                   "the compiler's pipelining of weight gathers across "
                                   'iterations')
  grads_in_param_dtype: bool = _key(False, "convert each layer weight's gradient to "
                                           '`param_dtype` inside the layer, as a plain cast '
                                           "does (MaxText's programs: the calibration rows); "
                                           'by default they stay in `dtype` until the '
                                           'optimizer, the same values in half the bytes')
  remat: str = _key('none', 'recompute activations: none | full (keep each block\'s input '
                            'only) | dots (keep projection outputs; `minimal`, MaxText\'s name) | '
                            'save_dot_except_mlp (keep the attention projections\' outputs, '
                            'recompute the MLP) | save_dot_except_qkv (keep all but the q/k/v '
                            'projections\' outputs)')
  attention: str = _key('xla', 'xla (softmax over the whole [t, s] logits) | blockwise (keys in '
                               'blocks of `attention_block`, online softmax: same result, less '
                               'memory) | splash (the Pallas splash kernel, TPUs) | cudnn (flash '
                               'attention, NVIDIA GPUs, bf16/fp16) | auto (per platform when the '
                               'run starts, recorded in config.json)')
  attention_block: int = _key(512, 'key positions per block of blockwise and splash attention '
                                   '(`seq_len` must be a multiple, or smaller)')
  fused_projections: bool = _key(False, 'one einsum for query/key/value (`attn.qkv`) and one for '
                                        'gate/up (`mlp.gate_up`) over weights joined each step: '
                                        'the input is gathered (its gradient reduce-scattered) '
                                        'once per block, not once per projection; same parameters')


@dataclasses.dataclass(frozen=True)
class Moe:
  """Mixture of Experts (models/moe.py; the decomposed all-to-all: parallelism/moe.py)."""
  num_experts: int = _key(0, 'experts per MoE layer; 0 keeps every MLP dense')
  top_k: int = _key(2, 'experts each token is routed to (gates renormalized when > 1)')
  every: int = _key(1, 'block i is MoE when (i + 1) % every == 0; with scan_layers, '
                       'num_layers must be a multiple')
  mlp_dim: int = _key(1024, "each expert's SwiGLU width (`mlp`)")
  capacity_factor: float = _key(1.25, 'slots per expert per sequence = ceil(factor x tokens x '
                                      'top_k / experts), rounded up to a multiple of '
                                      '`overlap_chunks`')
  dropless: bool = _key(False, 'capacity = sequence length: no token is dropped')
  load_balance_weight: float = _key(0.01, 'weight of the Switch/GShard load-balancing loss '
                                          '(mean over MoE layers)')
  router_z_weight: float = _key(1e-3, 'weight of the router z-loss')
  overlap_chunks: int = _key(2, 'capacity chunks of the decomposed expert all-to-all '
                                '(collective_matmul always/auto)')


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """AdamW and the learning-rate schedule (trainer/optim.py, trainer/step.py)."""
  learning_rate: float = _key(4e-3, 'peak learning rate')
  schedule: str = _key('cosine', 'after the warmup: cosine | linear (decay to end_lr_fraction '
                                 'x peak at `steps`) | constant | wsd (the peak, then a linear '
                                 'decay over the last decay_fraction of the steps) | rsqrt '
                                 '(peak * sqrt(max(warmup_steps, 1) / step))')
  warmup_steps: int = _key(30, 'linear warmup from 0 (at most `steps - 1`)')
  end_lr_fraction: float = _key(0.1, 'cosine, linear and wsd decay to this fraction of the '
                                     'peak at `steps`; in [0, 1]')
  decay_fraction: float = _key(0.2, 'wsd: fraction of `steps` (at the end) that decays; '
                                    'in [0, 1]')
  b1: float = _key(0.9, 'AdamW beta1')
  b2: float = _key(0.95, 'AdamW beta2')
  eps: float = _key(1e-8, 'AdamW epsilon')
  mu_dtype: str = _key('param', "AdamW's first moment: param (the master weights' dtype) | "
                                "float32 | bfloat16 (half of float32's memory, as MaxText's "
                                'mu_dtype)')
  nu_dtype: str = _key('param', "AdamW's second moment: param | float32 | bfloat16 (kept "
                                'in it between steps, updated in fp32; DeepSeek-V3 keeps both '
                                'moments in bf16)')
  weight_decay: float = _key(0.1, 'decoupled weight decay, matrices only')
  grad_clip: float = _key(1.0, 'global-norm clipping (0 disables)')
  grad_accum_steps: int = _key(1, 'microbatches averaged per update')
  z_loss: float = _key(1e-4, 'weight of log(Z)^2 (0 disables)')


@dataclasses.dataclass(frozen=True)
class Data:
  """Input data (trainer/data.py, trainer/pipeline.py, trainer/tokenizer.py)."""
  path: str = _key('', "a prepared corpus (a directory python -m trainer.prepare wrote), or "
                       "several separated by commas (a mixture); '' the embedded corpus, "
                       "'synthetic', a text file or glob, or .npy/.bin tokens")
  weights: str = _key('', "mixture: each corpus's share of the training sequences, one number "
                          "per data.path entry, e.g. '3,1'; '' weighs them by their tokens")
  eval_path: str = _key('', "prepared corpus whose held-out documents the evals score; '': "
                            "data.path's (required for a mixture)")
  prefetch: int = _key(4, 'training batches built ahead by a background thread (0: when the '
                          'step needs them)')
  bin_dtype: str = _key('uint16', 'dtype of raw .bin token files: uint16 | uint32')
  eval_fraction: float = _key(0.1, 'held-out tail of the token stream (sources other than '
                                   'prepared corpora)')
  tokenizer: str = _key('', "'' byte-level | a local Hugging Face tokenizer.json | a "
                            'SentencePiece .model | a directory holding one (never downloaded); '
                            'a prepared corpus must have been prepared with it')


DEFAULT_RULES = (('batch', ('data', 'fsdp')), ('residual_length', 'tensor'), ('vocab', 'tensor'),
                 ('embed', 'fsdp'), ('mlp', 'tensor'), ('heads', 'tensor'),
                 ('kv_heads', 'tensor'), ('exp', 'expert'))


@dataclasses.dataclass(frozen=True)
class Mesh:
  """The device mesh (parallelism/mesh.py) and logical-axis rules (parallelism/sharding.py)."""
  data: int = _key(4, 'data parallel (in-slice, ICI); one in-slice size may be -1; the product '
                      'with the dcn_* sizes must equal the device count')
  fsdp: int = _key(1, 'fully sharded data parallel (in-slice)')
  tensor: int = _key(2, 'tensor (model) parallel (in-slice)')
  expert: int = _key(1, 'expert parallel (in-slice)')
  dcn_data: int = _key(1, 'data parallel across slices (multi-slice)')
  dcn_fsdp: int = _key(1, 'fsdp across slices')
  dcn_tensor: int = _key(1, 'tensor parallel across slices')
  dcn_expert: int = _key(1, 'expert parallel across slices')
  logical_axis_rules: tuple = _key(DEFAULT_RULES, 'ordered [logical name, mesh axis | [mesh '
                                                  'axes] | None] table; first fit wins')

  def sizes(self) -> dict[str, int]:
    """The axis sizes (what parallelism/mesh.py reads)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != 'logical_axis_rules'}


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """Decomposed collective einsums (parallelism/sharding.py); each ring's schedule is the
  planner's (parallelism/schedule.py)."""
  collective_matmul: Literal['auto', 'always', 'never'] = _key(
      'auto', 'dense layers as collective einsums: auto (the cost model decides per layer) | '
      'always | never')
  ring_dtype: Literal['compute', 'float32'] = _key(
      'compute', "partial sums on the wire: compute (the model's dtype; adds in fp32) | float32")
  layer_overrides: str = _key('', "'PATTERN=FORM,...' (report's layer paths, * any part); "
                                  'FORM auto | ring | plain | gradients')
  plan: str = _key('', "a plan file to run instead of planning ('': plan; a resume runs "
                       "its workdir's plan.json)")
  tune: Literal['auto', 'model', 'measure'] = _key(
      'auto', "each layer's form: model (cost model) | measure (timed at start) | auto "
      '(measure off CPU)')


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """Checkpoints in WORKDIR/checkpoints/<step> (trainer/checkpoint.py)."""
  every: int = _key(130, 'steps between saves, plus one at the end and on SIGTERM; 0 turns '
                         'saving off (a workdir with checkpoints still resumes)')
  keep: int = _key(3, 'most recent checkpoints kept')
  keep_period: int = _key(0, 'also keep every step divisible by this (0: none)')
  async_save: bool = _key(True, 'write in the background while training goes on')
  on_corrupt: str = _key('error', 'a checkpoint failing its checksums: error (exit 1) | '
                                  'previous (set it aside as <step>.corrupt, resume from an '
                                  'older one)')


@dataclasses.dataclass(frozen=True)
class Distributed:
  """Multi-process runs (trainer/runtime.py; launch/local.py and launch/tpu_pod.py set them)."""
  coordinator_address: str = _key('', 'host:port of process 0; RINGTRAIN_COORDINATOR overrides')
  num_processes: int = _key(1, 'processes in the run; RINGTRAIN_NUM_PROCESSES overrides')
  process_id: int = _key(0, 'this process; RINGTRAIN_PROCESS_ID overrides')
  auto: bool = _key(False, 'TPU pod workers: JAX detects coordinator, count and id')
  bind_address: str = _key('', "where the coordinator listens; '': the coordinator address "
                               'itself when it is loopback, else all interfaces')
  initialization_timeout: int = _key(120, 'seconds to wait for every process to join')
  heartbeat_timeout: int = _key(15, 'seconds of silence after which a peer is declared dead')
  shutdown_timeout: int = _key(30, 'seconds to wait for peers at exit')


@dataclasses.dataclass(frozen=True)
class Profile:
  """A jax.profiler trace and the train step's HLO in WORKDIR/profile (trainer/profiling.py)."""
  start_step: int = _key(5, 'first update traced, counted from 0 (metrics.jsonl calls update k '
                            'step k+1)')
  num_steps: int = _key(0, 'updates traced (0: no trace)')
  dump_hlo: bool = _key(False, "write the compiled train step's optimized HLO to "
                               'profile/train_step.hlo.txt')


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The chip's profile (parallelism/hardware.py) and the host set-up (trainer/runtime.py)."""
  name: str = _key('auto', 'auto (detected from the devices; simulated CPU devices when no TPU '
                           'or GPU is visible) | cpu | tpu_v4 | tpu_v5p | tpu_v5e | tpu_v6e | '
                           'h100 | h200 (must match the devices): peak FLOP/s, cost model, '
                           'compiler flags')
  peak_flops: float = _key(0.0, "per-device peak override (0: from the profile; on CPU the "
                                "host's measured matmul rate / devices)")
  cpu_devices: int = _key(8, 'simulated CPU devices, unless RINGTRAIN_CPU_DEVICES is set')
  xla_flags: str = _key('default', "compiler flags on a TPU (LIBTPU_INIT_ARGS, also launch.aot) "
                                   "or a GPU (XLA_FLAGS): default (the chip's row) | 'default "
                                   "--a=1 ...' (the row, then these) | none | a "
                                   'space-separated list used instead')


@dataclasses.dataclass(frozen=True)
class Aot:
  """Ahead-of-time compilation for a TPU slice (launch/aot.py, benchmarks/calibrate.py)."""
  topology: str = _key('', "the slice python -m launch.aot compiles for when --topology is not "
                           "given: <chip>:AxBxC, e.g. 'v4:8x8x16' ('': none)")
  measured_mfu: float | None = _key(None, "a calibration config's measured MFU (None: none)")
  measured_attention: str = _key('causal', 'the attention FLOPs measured_mfu counts: causal '
                                           '(each (query, key) pair once, as our MFU) | full '
                                           "(every pair, as MaxText's MFU before its PR #1988) | "
                                           "none (6 x parameters a token, MaxText's in 2023)")


@dataclasses.dataclass(frozen=True)
class Config:
  """A run: its length, batches and evals, then one group of keys per concern."""
  seed: int = _key(0, 'parameter init and data order (document shuffles, windows)')
  steps: int = _key(520, 'run length and length of the LR schedule')
  stop_after: int | None = _key(None, 'end this run after that step (as a preemption would: a '
                                      'checkpoint is saved); the schedule is unchanged')
  batch_size: int = _key(32, 'global batch, in sequences; divisible by data*fsdp*'
                             'grad_accum_steps')
  seq_len: int = _key(256, 'tokens per packed sequence; at most model.max_seq_len')
  log_every: int = _key(10, 'steps between training records')
  eval_every: int = _key(130, 'steps between evals; an eval always ends the run (0: only then)')
  eval_steps: int = _key(4, 'fixed held-out batches per eval')
  init_from: str = _key('', "take parameters (only) from this checkpoint: a workdir, its "
                            "checkpoints/ or a step directory; any mesh ('': none)")
  on_nonfinite: str = _key('stop', 'NaN/inf loss or gradient norm: stop (exit 3, naming the '
                                   'step) | skip (drop that update)')
  model: Model = _group(Model)
  moe: Moe = _group(Moe)
  optimizer: Optimizer = _group(Optimizer)
  data: Data = _group(Data)
  mesh: Mesh = _group(Mesh)
  parallelism: Parallelism = _group(Parallelism)
  checkpoint: Checkpoint = _group(Checkpoint)
  distributed: Distributed = _group(Distributed)
  profile: Profile = _group(Profile)
  hardware: Hardware = _group(Hardware)
  aot: Aot = _group(Aot)

  def validate(self) -> None:
    """Raises ValueError naming the first bad value (see trainer/validation.py)."""
    # JAX, which loading a config (--help, launch/local.py) does without:
    from trainer import validation  # pylint: disable=g-import-not-at-top
    validation.validate(self)

  def transformer(self):
    """The model's own config (models/transformer.py): ``model.*`` with ``moe.*``."""
    # JAX, which loading a config (--help, launch/local.py) does without:
    # pylint: disable=g-import-not-at-top
    from models.moe import MoeConfig
    from models.transformer import TransformerConfig
    return TransformerConfig(**dataclasses.asdict(self.model),
                             moe=MoeConfig(**dataclasses.asdict(self.moe)))

  def replace(self, changes: dict[str, Any]) -> 'Config':
    """A copy with ``{'a.b': value}`` changed (values of the keys' types)."""
    values = self.to_dict()
    for key, value in changes.items():
      _set(values, key, value)
    return from_dict(values)

  def to_dict(self) -> dict:
    """Plain JSON-able values (lists for tuples), in declaration order."""
    return json.loads(self.to_json())

  def to_json(self, indent: int | None = None) -> str:
    return json.dumps(dataclasses.asdict(self), indent=indent)


# ---- from a ConfigDict, a dict and overrides ------------------------------------------


def load(spec: str, overrides: Sequence[str] = ()) -> Config:
  """Loads ``spec`` (``file.py[:arg]``) and applies ``--config.k=v`` overrides."""
  return build(load_dict(spec), overrides)


def load_dict(spec: str) -> dict:
  """The values of config file ``spec``'s ``get_config()`` (a ConfigDict), as a dict."""
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise ConfigError(f'config file not found: {path}{hints_lib.config_files(path)}')
  module_spec = importlib.util.spec_from_file_location('_run_config', path)
  if module_spec is None:  # e.g. a run's config.json
    raise ConfigError(f'config file {path} is not a Python module (a .py with get_config())')
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, 'get_config'):
    raise ConfigError(f'config file {path} has no get_config()')
  try:  # a wrong call is the user's spec, not a bug: one line
    inspect.signature(module.get_config).bind(*[arg] if arg else [])
  except TypeError as e:
    raise ConfigError(f'{spec}: cannot call get_config({repr(arg) if arg else ""}): {e}'
                      ) from None
  try:
    cfg = module.get_config(arg) if arg else module.get_config()
  except ValueError as e:  # a config that refuses its argument
    raise ConfigError(f'{spec}: {e}') from None
  return cfg.to_dict()


def build(values: dict, overrides: Sequence[str] = ()) -> Config:
  """A Config from nested ``values`` (a config file's, or config.json's) and overrides."""
  values = copy.deepcopy(values)
  for key, raw in parse_overrides(overrides):
    kind = key_types().get(key) or _unknown(key)
    _set(values, key, _parse(raw, kind, key))
  return from_dict(values)


def from_dict(values: dict, cls: type = Config, prefix: str = '') -> Any:
  """Checks ``values`` against ``cls``'s keys and types; missing keys take the defaults."""
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in values.items():
    key = prefix + name
    if name not in hints:
      _unknown(key)
    if dataclasses.is_dataclass(hints[name]):
      if not isinstance(value, dict):
        raise ConfigError(f'config.{key} is a group of keys, not {value!r}')
      kwargs[name] = from_dict(value, hints[name], key + '.')
    else:
      kwargs[name] = _checked(value, hints[name], key)
  return cls(**kwargs)


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
  """``['--config.a=1', '--config.b', '2']`` -> ``[('a', '1'), ('b', '2')]``."""
  out, i = [], 0
  while i < len(args):
    arg = args[i]
    if not arg.startswith('--config.'):
      close = (hints_lib.suggest(arg.lstrip('-').partition('=')[0], key_types())
               if arg.startswith('--') else None)
      _, eq, raw = arg.partition('=')
      hint = f' (did you mean --config.{close}{eq}{raw}?)' if close else ''
      raise ConfigError(f'unrecognized argument: {arg}{hint}')
    key, eq, raw = arg[len('--config.'):].partition('=')
    if not eq:
      if i + 1 >= len(args):
        raise ConfigError(f'no value given for --config.{key}')
      raw, i = args[i + 1], i + 1
    out.append((key, raw))
    i += 1
  return out


def key_types() -> dict[str, Any]:
  """Every dotted key -> its type."""
  return {key: kind for prefix, cls in _sections() for key, kind, _, _ in _rows(cls, prefix)}


def _unknown(key: str) -> typing.NoReturn:
  """Raises ConfigError naming the first unknown part of ``key``, with a suggestion."""
  parts = key.split('.')
  known = key_types()
  groups = {prefix[:-1] for prefix, _ in _sections()}
  first = next(('.'.join(parts[:i]) for i in range(1, len(parts))
                if '.'.join(parts[:i]) not in groups), key)
  close = hints_lib.suggest(key, known)
  hint = f' (did you mean config.{close}?)' if close else ''
  raise ConfigError(f'unknown config key: config.{first}{hint}')


def _set(values: dict, key: str, value: Any) -> None:
  *parents, leaf = key.split('.')
  for part in parents:
    values = values.setdefault(part, {})
  values[leaf] = value


def _base(kind: Any) -> Any:
  """``int | None`` -> int, ``Literal['a', 'b']`` -> str; other types unchanged."""
  if typing.get_origin(kind) is Literal:
    return type(typing.get_args(kind)[0])
  args = [a for a in typing.get_args(kind) if a is not type(None)]
  return args[0] if typing.get_origin(kind) is not None and len(args) == 1 else kind


def _type_name(kind: Any) -> str:
  return getattr(_base(kind), '__name__', str(kind))


def _optional(kind: Any) -> bool:
  """Whether ``kind`` admits None (``int | None``)."""
  return typing.get_origin(kind) is not Literal and type(None) in typing.get_args(kind)


def _shown_type(kind: Any) -> str:
  return _type_name(kind) + (' or None' if _optional(kind) else '')


def _parse(raw: str, kind: Any, key: str) -> Any:
  """A command-line string as a value of ``kind``."""
  base = _base(kind)
  try:
    if _optional(kind) and raw.lower() == 'none':
      return None
    if base is bool:
      if raw.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(raw)
      return raw.lower() in ('true', '1')
    if base in (str, int, float):
      return base(raw)
    return ast.literal_eval(raw)
  except (TypeError, ValueError, SyntaxError):
    raise ConfigError(f'config.{key}={raw!r} is not a valid {_type_name(kind)}') from None


def _checked(value: Any, kind: Any, key: str) -> Any:
  """``value`` as ``kind`` (ints accepted as floats, lists frozen to tuples)."""
  base = _base(kind)
  if value is None and _optional(kind):
    return None
  if base is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if base is tuple and isinstance(value, (list, tuple)):
    return _frozen(value)
  if typing.get_origin(kind) is Literal and isinstance(value, base):
    if value in typing.get_args(kind):
      return value
    raise ConfigError(f'config.{key}={value!r} is not one of '
                      + ', '.join(map(repr, typing.get_args(kind))))
  if isinstance(value, base) and not (base is int and isinstance(value, bool)):
    return value
  raise ConfigError(f'config.{key}={value!r} is not a valid {_type_name(kind)}')


def _frozen(value: Any) -> Any:
  return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


# ---- documentation: --help and configs/README.md --------------------------------------


@functools.cache
def _sections() -> list[tuple[str, type]]:
  """(key prefix, dataclass) of the top-level keys, then of each group."""
  hints = typing.get_type_hints(Config)
  return [('', Config)] + [(f'{name}.', kind) for name, kind in hints.items()
                           if dataclasses.is_dataclass(kind)]


def _rows(cls: type, prefix: str) -> list[tuple[str, Any, Any, str]]:
  """(dotted key, type, default, meaning) of ``cls``'s keys (not its groups)."""
  hints = typing.get_type_hints(cls)
  return [(prefix + f.name, hints[f.name], f.default, f.metadata['help'])
          for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]


def _shown(default: Any) -> str:
  return 'configs/default.py' if isinstance(default, tuple) else repr(default)


def help_text() -> str:
  """Every config key with its type, default and meaning, grouped by section."""
  lines = ['config keys (override with --config.KEY=VALUE; the value is parsed as the '
           "key's type):"]
  for prefix, cls in _sections():
    lines += ['', f'  {prefix + "*" if prefix else "top level"}: {cls.__doc__}']
    for key, kind, default, meaning in _rows(cls, prefix):
      lines += textwrap.wrap(f'config.{key} ({_shown_type(kind)}, default {_shown(default)}): '
                             f'{meaning}',
                             width=100, initial_indent='    ', subsequent_indent='        ')
  return '\n'.join(lines)


def add_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Makes ``parser``'s --help list every config key after its own options."""
  parser.formatter_class = argparse.RawDescriptionHelpFormatter
  parser.epilog = help_text()
  return parser


MARKDOWN_HEAD = """\
# Config keys

<!-- Generated by `python -m trainer.config --markdown > configs/README.md` from the
dataclasses in trainer/config.py; tests/test_config.py checks that it is current. -->

A config is `configs/<name>.py` with `get_config()` returning an `ml_collections.ConfigDict`.
The entry point converts it once into the frozen dataclasses of `trainer/config.py`, which
the code below it reads. Override any key on the command line: `--config.a.b=value` (the
value is parsed as the key's type; unknown keys, with a suggestion, and wrong types exit with
status 2). `python -m trainer.train --help` lists the same keys. The resolved config of a run
is written to `WORKDIR/config.json`. Keys a config leaves out take the defaults below, which
are those of `configs/default.py`. Later work adds keys to `trainer/config.py` rather than
inventing parallel names.
"""


def markdown() -> str:
  """configs/README.md: a table of the keys per section."""
  out = [MARKDOWN_HEAD]
  for prefix, cls in _sections():
    out += [f'## {prefix[:-1] or "top level"}', '', cls.__doc__, '',
            '| key | type | default | meaning |', '|---|---|---|---|']
    out += [f'| `{key}` | {_shown_type(kind)} | `{_shown(default)}` | '
            f'{meaning.replace("|", "&#124;")} |'
            for key, kind, default, meaning in _rows(cls, prefix)]
    out.append('')
  return '\n'.join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m trainer.config', description=__doc__)
  parser.add_argument('--markdown', action='store_true', help='print configs/README.md')
  args = parser.parse_args(argv)
  print(markdown() if args.markdown else help_text(), end='' if args.markdown else '\n')
  return 0


if __name__ == '__main__':
  from parallelism import cli  # pylint: disable=g-import-not-at-top  # JAX: only as a command
  cli.run(main)
