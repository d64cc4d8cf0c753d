"""Hints on the command line: the config key or file bad input probably meant, and
paths as a printed command names them.

trainer/config.py words its errors with them (an unknown key, an argument that is
no ``--config.`` override, a config file that does not exist); trainer/prepare.py
the train command it prints. A command that needs a missing optional extra of
setup.py names install_hint(extra): the Makefile's own install (the venv's pip,
the exact versions of constraints.txt), run from the repository root.
"""

from __future__ import annotations

import difflib
import os
from typing import Iterable

# The Makefile's INSTALL, less its --quiet (tests/test_papercuts.py compares them).
PIP_INSTALL = '.venv/bin/python -m pip install -c constraints.txt -e'

# What other trainers (nanoGPT, Hugging Face, MaxText, PyTorch Lightning) call our keys:
# an unknown key is matched by meaning before spelling (``lr`` is not ``b2``).
ALIASES = {
    'learning_rate': ('lr', 'peak_lr', 'max_lr', 'base_lr'),
    'batch_size': ('bs', 'batch', 'global_batch_size', 'train_batch_size'),
    'weight_decay': ('wd',),
    'warmup_steps': ('warmup', 'num_warmup_steps', 'warmup_iters'),
    'steps': ('max_steps', 'num_steps', 'train_steps', 'total_steps', 'num_train_steps',
              'max_iters', 'iterations'),
    'seq_len': ('seq_length', 'sequence_length', 'context', 'context_length', 'block_size',
                'max_target_length'),
    'max_seq_len': ('max_position_embeddings',),
    'num_layers': ('n_layer', 'n_layers', 'num_hidden_layers', 'depth'),
    'd_model': ('n_embd', 'hidden_size', 'emb_dim', 'embed_dim', 'dim'),
    'num_heads': ('n_head', 'n_heads', 'num_attention_heads', 'num_query_heads'),
    'num_kv_heads': ('n_kv_heads', 'n_kv_head', 'num_key_value_heads'),
    'mlp_dim': ('intermediate_size', 'ffn_dim', 'd_ff', 'ffn_hidden_size'),
    'vocab_size': ('vocab', 'n_vocab'),
    'grad_clip': ('max_grad_norm', 'clip_grad_norm', 'gradient_clipping', 'grad_clip_norm'),
    'grad_accum_steps': ('gradient_accumulation_steps', 'grad_accum', 'accumulate_grad_batches'),
    'b1': ('beta1', 'adam_beta1', 'adam_b1'),
    'b2': ('beta2', 'adam_beta2', 'adam_b2'),
    'eps': ('epsilon', 'adam_eps', 'adam_epsilon'),
    'eval_every': ('eval_interval', 'eval_period'),
    'eval_steps': ('eval_iters',),
    'log_every': ('log_interval', 'log_period', 'logging_steps'),
    'checkpoint.every': ('save_every', 'save_interval', 'save_steps', 'checkpoint_every',
                         'checkpoint_period'),
    'data.path': ('dataset', 'data_dir', 'data_path', 'train_data'),
    'num_experts': ('n_experts', 'num_local_experts'),
    'top_k': ('num_experts_per_tok', 'num_experts_per_token'),
}
_MEANINGS = {alias: key for key, aliases in ALIASES.items() for alias in aliases}


def suggest(key: str, known: Iterable[str]) -> str | None:
  """The key of ``known`` (dotted config keys) an unknown ``key`` most likely means, or None.

  First by meaning: its last part is a key of another group (``d_model`` is
  ``model.d_model``) or another trainer's name of one (``lr``: ALIASES); in the
  group ``key`` names, where there is one. Then by spelling.
  """
  known = list(known)
  group, _, leaf = key.replace('-', '_').rpartition('.')
  meant = _MEANINGS.get(leaf, leaf)
  same = [k for k in known if k == meant or k.endswith('.' + meant)]
  if same:
    return next((k for k in same if k.startswith(group + '.')), same[0]) if group else same[0]
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
  return close[0] if close else None


def config_files(path: str) -> str:
  """What follows 'config file not found': the nearest name and every file in configs/."""
  folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'configs')
  shown = shown_path(folder)
  names = sorted(n for n in os.listdir(folder) if n.endswith('.py') and not n.startswith('_'))
  close = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.8)
  return ((f' (did you mean {os.path.join(shown, close[0])}?)' if close else '')
          + f'; the configs in {shown}/: ' + ', '.join(names))


def shown_path(path: str) -> str:
  """``path`` as a command shown to the user names it: relative to the working
  directory when inside it, else absolute."""
  relative = os.path.relpath(path)
  return os.path.normpath(os.path.abspath(path)) if relative.startswith('..') else relative


def install_hint(extra: str) -> str:
  """``.venv/bin/python -m pip install -c constraints.txt -e '.[extra]'``."""
  return f"{PIP_INSTALL} '.[{extra}]'"
