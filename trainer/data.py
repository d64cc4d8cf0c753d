"""Input pipeline: corpus -> token stream -> packed, deterministic batches.

Sources (``data.path``):
  * ``''``: the embedded default corpus, the Python standard library source of
    the running interpreter (the ``*.py`` files directly in the directory of the
    ``os`` module, sorted by name, concatenated), as text;
  * a text file or glob: text, one document per file;
  * ``.npy`` / ``.bin`` (raw ``data.bin_dtype``) arrays of token ids;
  * ``'synthetic'``: uniformly random tokens (for benchmarks).

Text is tokenized with ``data.tokenizer`` (trainer/tokenizer.py: byte-level by
default, or a local Hugging Face / SentencePiece file). Documents are joined
with an end-of-document token (none if the tokenizer has none); the last
``data.eval_fraction`` of the stream is held out. The batch for step k is a
pure function of (seed, k): a resumed run sees exactly the batches it would
have seen. Each process materializes only the rows of the global batch that
its devices hold.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from typing import Any

import jax
import numpy as np

from trainer import tokenizer as tokenizer_lib

BYTE_VOCAB = tokenizer_lib.BYTE_VOCAB
EOS_ID = tokenizer_lib.EOS_ID  # end of document; follows every document in the stream
TOKENIZER_VOCAB = tokenizer_lib.BYTE_TOKENIZER_VOCAB


def default_corpus_files() -> list[str]:
  """The ``*.py`` files directly in the directory of the ``os`` module, sorted."""
  return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), '*.py')))


def encode_documents(docs: list[bytes], tok: tokenizer_lib.Tokenizer | None = None):
  """(token stream, UTF-8 bytes per token): ``tok`` ids, its EOS after each document.

  Byte-level by default (each byte its own id). End-of-document tokens account
  for -1 bytes: they are not text (bits per byte leaves them out).
  """
  tok = tok or tokenizer_lib.ByteTokenizer()
  texts = docs if tok.byte_level else [d.decode('utf-8', errors='replace') for d in docs]
  eos = [] if tok.eos_id is None else [tok.eos_id]
  ids, counts = [], []
  for doc_ids, doc_bytes in tok.encode_documents(texts):
    ids += [doc_ids, np.array(eos, np.int32)]
    counts += [doc_bytes, np.full(len(eos), -1, np.int32)]
  if not ids:
    return np.zeros((0,), np.int32), np.zeros((0,), np.int32)
  return np.concatenate(ids), np.concatenate(counts)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A token stream split into train and held-out parts."""
  train: np.ndarray
  eval: np.ndarray
  byte_level: bool  # tokens < BYTE_VOCAB are bytes (bits per byte is defined)
  eos_id: int | None
  description: str
  # Text through another tokenizer: UTF-8 bytes each held-out token accounts for
  # (-1: end of document), which keeps bits per byte defined.
  eval_bytes: np.ndarray | None = None


def load_corpus(data_cfg: Any, vocab_size: int, seed: int) -> Corpus:
  """Reads ``data.path``; raises ValueError naming the problem."""
  path = data_cfg.path
  spec = data_cfg.get('tokenizer', '')
  tok = tokenizer_lib.load(spec)
  if spec or not (path == 'synthetic' or path.endswith(('.npy', '.bin'))):  # text data
    tokenizer_lib.check_vocab(tok, vocab_size)
  byte_level, eos, counts = tok.byte_level, tok.eos_id, None
  if path == '':
    files = default_corpus_files()
    tokens, counts = _read_text(files, tok)
    desc = f'embedded corpus: {len(files)} files from {os.path.dirname(os.__file__)}'
  elif path == 'synthetic':
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=1 << 22, dtype=np.int32)
    byte_level, eos, desc = False, None, 'synthetic random tokens'
  elif path.endswith(('.npy', '.bin')):
    tokens = _read_token_file(path, data_cfg.bin_dtype)
    byte_level, eos, desc = False, None, f'token file {path}'
  else:
    files = sorted(glob.glob(path))
    if not files:
      raise ValueError(f'data.path={path!r} matches no file')
    folders = [f for f in files if os.path.isdir(f)]
    if folders:
      raise ValueError(f'data.path={path!r} names a directory ({folders[0]}): name text files '
                       f'or a glob of them, e.g. {os.path.join(folders[0], "*.txt")}')
    tokens, counts = _read_text(files, tok)
    desc = f'{len(files)} text file(s) from {path}'
  if counts is not None and not tok.byte_level:
    desc += f', tokenized with {tok.name}' + (
        '' if eos is not None else ' (it has no end-of-document token: documents are '
        'concatenated)')
  if tokens.size and int(tokens.max()) >= vocab_size:
    raise ValueError(f'data.path={path!r} has token id {int(tokens.max())} >= '
                     f'model.vocab_size={vocab_size}')
  if not 0 < data_cfg.eval_fraction < 1:
    raise ValueError(f'data.eval_fraction={data_cfg.eval_fraction} is not in (0, 1)')
  split = int(len(tokens) * (1 - data_cfg.eval_fraction))
  eval_bytes = None if byte_level or counts is None else counts[split:]
  return Corpus(tokens[:split], tokens[split:], byte_level, eos, desc, eval_bytes)


def _read_text(files: list[str], tok) -> tuple[np.ndarray, np.ndarray]:
  docs = []
  for name in files:
    with open(name, 'rb') as f:
      docs.append(f.read())
  if not sum(len(d) for d in docs):
    raise ValueError(f'corpus is empty: {len(files)} file(s), 0 bytes')
  return encode_documents(docs, tok)


def _read_token_file(path: str, bin_dtype: str) -> np.ndarray:
  if not os.path.isfile(path):
    raise ValueError(f'data.path={path!r} ' + ('is not a file' if os.path.exists(path)
                                                else 'does not exist'))
  if path.endswith('.npy'):
    tokens = np.load(path, allow_pickle=False)
  else:
    if bin_dtype not in ('uint16', 'uint32'):
      raise ValueError(f'data.bin_dtype={bin_dtype!r} is not uint16 or uint32')
    tokens = np.fromfile(path, dtype=bin_dtype)
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f'data.path={path!r} is not a 1-D integer token array')
  if not tokens.size:
    raise ValueError(f'corpus is empty: {path} has 0 tokens')
  return tokens.astype(np.int32)


def check_lengths(corpus: Corpus, seq_len: int, batch_size: int, eval_steps: int) -> None:
  """Raises ValueError if the splits cannot fill the requested batches."""
  if len(corpus.train) < seq_len + 1:
    raise ValueError(f'training split has {len(corpus.train)} tokens, fewer '
                     f'than seq_len+1={seq_len + 1}')
  need = eval_steps * batch_size * seq_len + 1
  if len(corpus.eval) < need:
    raise ValueError(f'held-out split has {len(corpus.eval)} tokens; eval_steps='
                     f'{eval_steps} x batch_size={batch_size} x seq_len={seq_len} '
                     f'needs {need}')


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int,
             eos_id: int | None) -> dict[str, np.ndarray]:
  """Packed examples: inputs, targets, positions and segment (document) ids."""
  idx = starts[:, None] + np.arange(seq_len + 1)[None]
  window = stream[idx]
  inputs, targets = window[:, :-1], window[:, 1:]
  if eos_id is None:
    segments = np.zeros_like(inputs)
  else:  # a new document starts after each EOS
    segments = np.cumsum(inputs == eos_id, axis=1) - (inputs == eos_id)
  ar = np.broadcast_to(np.arange(seq_len), inputs.shape)
  starts_of_segment = np.where(np.diff(segments, axis=1, prepend=-1) != 0, ar, 0)
  positions = ar - np.maximum.accumulate(starts_of_segment, axis=1)
  return {'inputs': inputs, 'targets': targets,
          'positions': positions.astype(np.int32), 'segments': segments.astype(np.int32)}


def train_rows(corpus: Corpus, seed: int, step: int, batch_size: int,
               seq_len: int, rows: np.ndarray) -> dict[str, np.ndarray]:
  """Rows ``rows`` of the global training batch for ``step``."""
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, len(corpus.train) - seq_len, size=batch_size)
  return _windows(corpus.train, starts[rows], seq_len, corpus.eos_id)


def eval_rows(corpus: Corpus, index: int, batch_size: int, seq_len: int,
              rows: np.ndarray) -> dict[str, np.ndarray]:
  """Rows of held-out batch ``index``: consecutive, non-overlapping windows.

  With a tokenizer other than bytes, ``target_bytes`` holds the UTF-8 bytes
  each target accounts for (-1: end of document).
  """
  starts = (index * batch_size + np.arange(batch_size)) * seq_len
  out = _windows(corpus.eval, starts[rows], seq_len, corpus.eos_id)
  if corpus.eval_bytes is not None:
    out['target_bytes'] = corpus.eval_bytes[starts[rows][:, None] + 1 + np.arange(seq_len)]
  return out


def local_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> np.ndarray:
  """Indices of the batch rows this process's devices hold, in order."""
  rows = set()
  for index in sharding.addressable_devices_indices_map(global_shape).values():
    rows.update(range(*index[0].indices(global_shape[0])))
  return np.array(sorted(rows))


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding,
              global_batch: int) -> dict[str, jax.Array]:
  """Assembles per-process rows into global arrays laid out as ``sharding``."""
  return {k: jax.make_array_from_process_local_data(
              sharding, v, (global_batch,) + v.shape[1:])
          for k, v in batch.items()}


def gzip_bits_per_byte(data: bytes) -> float:
  """Reference compressor: ``gzip -9`` size of ``data`` in bits per byte."""
  import gzip  # pylint: disable=g-import-not-at-top
  return 8 * len(gzip.compress(data, compresslevel=9)) / max(len(data), 1)


def held_out_bytes(corpus: Corpus) -> bytes:
  """The held-out byte text (documents separated by newlines) of a byte corpus."""
  ev = corpus.eval
  return bytes(np.where(ev == EOS_ID, ord('\n'), ev).astype(np.uint8))


def main() -> None:
  """``python -m trainer.data``: the embedded corpus and its gzip -9 baseline."""
  from trainer import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(os.path.join(os.path.dirname(__file__), '..', 'configs', 'default.py'))
  corpus = load_corpus(cfg.data, cfg.model.vocab_size, cfg.seed)
  text = held_out_bytes(corpus)
  n_eval = cfg.eval_steps * cfg.batch_size * cfg.seq_len
  subset = held_out_bytes(dataclasses.replace(corpus, eval=corpus.eval[:n_eval]))
  print(corpus.description)
  print(f'train tokens {len(corpus.train):,}  held-out tokens {len(corpus.eval):,}')
  print(f'gzip -9, whole held-out text ({math.ceil(len(text) / 1024)} KiB): '
        f'{gzip_bits_per_byte(text):.3f} bits per byte')
  print(f'gzip -9, the {n_eval:,} held-out tokens the default eval scores: '
        f'{gzip_bits_per_byte(subset):.3f} bits per byte')


if __name__ == '__main__':
  main()
