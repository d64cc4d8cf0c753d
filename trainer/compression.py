"""Reference compressors' bits per byte on the held-out bytes an eval scores.

An eval (trainer/loop.py) scores ``eval_steps`` batches of ``batch_size`` x
``seq_len`` consecutive held-out sequences; their targets are held-out tokens
1 ... N (N = eval_steps x batch_size x seq_len), and on byte-level data its bits
per byte count the targets that are bytes (end-of-document tokens are scored
but carry none: trainer/step.py). ``gzip -9`` and ``xz -9e`` (Python's gzip
and lzma modules) compress exactly those bytes, so each eval line can say how
the model compares: bits per byte = 8 x compressed size / bytes scored.
Corpora through another tokenizer (or token ids) have no reference.
"""

from __future__ import annotations

import gzip
import lzma
from typing import Any

import numpy as np

from trainer import tokenizer as tokenizer_lib

# record key -> (what the eval line calls it, compress(bytes) -> bytes)
COMPRESSORS = {
    'gzip_bpb': ('gzip -9', lambda b: gzip.compress(b, compresslevel=9, mtime=0)),
    'xz_bpb': ('xz -9e', lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME)),
}


def bits_per_byte(data: bytes, key: str = 'gzip_bpb') -> float:
  """``data`` compressed by the compressor of ``COMPRESSORS[key]``, in bits per byte."""
  return 8 * len(COMPRESSORS[key][1](data)) / max(len(data), 1)


def scored_bytes(tokens: np.ndarray) -> bytes:
  """The bytes among byte-level ``tokens`` (end-of-document and other specials left out)."""
  tokens = np.asarray(tokens).astype(np.int64)
  return bytes(tokens[(tokens >= 0) & (tokens < tokenizer_lib.BYTE_VOCAB)].astype(np.uint8))


def held_out_bytes(stream: Any, num_targets: int) -> bytes:
  """The bytes an eval of ``num_targets`` targets scores: tokens 1 ... num_targets of
  ``stream`` (a byte-level trainer.data.Stream of held-out documents)."""
  tokens = np.empty(num_targets, stream.dtype)
  stream.read(1, num_targets + 1, tokens)
  return scored_bytes(tokens)


def reference(data: Any, batch_size: int, seq_len: int, eval_steps: int) -> dict[str, float]:
  """Every compressor's bits per byte on what the run's evals score ({} unless byte-level).

  ``data`` is the run's trainer.data.Data. Computed once per run (trainer/loop.py
  keeps it beside the held-out batches): xz -9e takes about a second per MB.
  """
  if not data.byte_level:
    return {}
  held = held_out_bytes(data.eval, eval_steps * batch_size * seq_len)
  return {key: bits_per_byte(held, key) for key in COMPRESSORS}


def describe(record: dict[str, Any]) -> str:
  """The eval line's part for the references in ``record``: ' (gzip -9 1.850, xz -9e ...)'."""
  parts = [f'{name} {record[key]:.3f}' for key, (name, _) in COMPRESSORS.items()
           if key in record]
  return f" ({', '.join(parts)})" if parts else ''
