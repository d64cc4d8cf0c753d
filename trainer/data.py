"""Input data: where the tokens come from, as documents read by position.

Sources (``data.path``):
  * a prepared corpus: a directory ``python -m trainer.prepare`` wrote (token
    shards read from disk by position, an index of document boundaries, the
    held-out documents apart), or several separated by commas: a mixture,
    weighted by ``data.weights``;
  * ``''``: the embedded default corpus, the Python standard library source of
    the running interpreter (the ``*.py`` files directly in the directory of the
    ``os`` module, sorted by name, concatenated), as text;
  * a text file or glob: text, one document per file, tokenized at every start;
  * ``.npy`` / ``.bin`` (raw ``data.bin_dtype``) arrays of token ids, memory-mapped
    (with ``data.tokenizer=''``, a model of the byte vocabulary and every id a byte
    or EOS, below 257, such as a byte-level prepared corpus's shard: bytes, whose
    evals report bits per byte);
  * ``'synthetic'``: uniformly random tokens (for benchmarks).

Every source becomes :class:`Stream` s: documents in stored order, each
followed by the tokenizer's end-of-document token, whose tokens are read by
position. Prepared corpora and token files stay on disk (host memory holds
their document index, 8 bytes a document, not their tokens). The other sources hold out the last
``data.eval_fraction`` of their token stream; a prepared corpus has its
held-out documents apart, and ``data.eval_path`` can name another's. How
batches are cut from the streams (shuffling, packing, mixing, prefetching,
resuming): trainer/pipeline.py.

A prepared corpus directory (written by trainer/prepare.py, read here):

  corpus.json          the manifest, written last: without it nothing there is a corpus
  train-NNNNN.bin      tokens (little-endian ``dtype`` of the manifest), documents back to back
  train-NNNNN.idx      int64 document boundaries in that shard: 0, end of doc 1, ..., its length
  eval-NNNNN.bin/.idx  the held-out documents, the same way
  eval-NNNNN.bytes     int32 UTF-8 bytes of text each held-out token stands for (-1: end of
                       document); tokenizers other than bytes only (bits per byte)

Opening one checks each file's size against the manifest and reads every
token shard once, in bounded pieces (``FileArray.max``): a token id at or
above ``model.vocab_size`` (a shard or manifest changed since it was
prepared) is refused naming the shard and the id, not trained into a NaN
loss. Text files and globs are read only when they are regular files (a FIFO
would block, a device never end); with a tokenizer other than bytes, a file
that is not UTF-8 is refused naming the byte.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import glob
import hashlib
import json
import math
import os
import weakref

import numpy as np

from trainer import compression, config as config_lib, files as files_lib
from trainer import tokenizer as tokenizer_lib
from trainer.config import Data as DataConfig

BYTE_VOCAB = tokenizer_lib.BYTE_VOCAB
EOS_ID = tokenizer_lib.EOS_ID  # end of document; follows every document in the stream
TOKENIZER_VOCAB = tokenizer_lib.BYTE_TOKENIZER_VOCAB
FORMAT = 'ringtrain-prepared-1'
MANIFEST = 'corpus.json'
SPLITS = ('train', 'eval')
SCAN_ITEMS = 1 << 22  # tokens per read of a shard's scan for its largest id


def default_corpus_files() -> list[str]:
  """The ``*.py`` files directly in the directory of the ``os`` module, sorted."""
  return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), '*.py')))


def encode_documents(docs: list, tok: tokenizer_lib.Tokenizer | None = None):
  """(token stream, UTF-8 bytes per token, document lengths) of ``docs``.

  ``tok``'s ids with its EOS after each document; byte-level by default (each
  byte its own id; ``docs`` may be bytes, kept as they are). End-of-document
  tokens account for -1 bytes: they are not text (bits per byte leaves them out).
  """
  tok = tok or tokenizer_lib.ByteTokenizer()
  texts = docs if tok.byte_level else [
      d.decode('utf-8', errors='replace') if isinstance(d, bytes) else d for d in docs]
  eos = [] if tok.eos_id is None else [tok.eos_id]
  ids, counts, lengths = [], [], []
  for doc_ids, doc_bytes in tok.encode_documents(texts):
    ids += [doc_ids, np.array(eos, np.int32)]
    counts += [doc_bytes, np.full(len(eos), -1, np.int32)]
    lengths.append(len(doc_ids) + len(eos))
  if not ids:
    return np.zeros((0,), np.int32), np.zeros((0,), np.int32), np.zeros((0,), np.int64)
  return np.concatenate(ids), np.concatenate(counts), np.array(lengths, np.int64)


def bounds_of(lengths: np.ndarray) -> np.ndarray:
  """Document boundaries (0, end of the first, ..., total) from lengths; empty ones dropped."""
  return np.unique(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))


class Stream:
  """Documents in stored order, their tokens read by position.

  ``shards`` are 1-D integer arrays (:class:`FileArray` s for prepared corpora)
  read as one sequence; ``bounds`` (int64) are where documents start in it,
  then its length. ``byte_counts`` (held-out splits of tokenizers other than
  bytes): per token, the UTF-8 bytes of text it stands for.
  """

  def __init__(self, shards, bounds, byte_counts=None):
    self.shards, self.byte_counts = list(shards), byte_counts
    self.dtype = self.shards[0].dtype  # of every shard
    self._base = [0] + np.cumsum([len(s) for s in self.shards]).tolist()
    self.bounds = np.asarray(bounds, np.int64)

  @property
  def num_tokens(self) -> int:
    return self._base[-1]

  @property
  def num_docs(self) -> int:
    return len(self.bounds) - 1

  def tokens(self) -> np.ndarray:
    """All tokens as one array (small streams and tests)."""
    out = np.empty(self.num_tokens, self.dtype)
    self.read(0, self.num_tokens, out)
    return out.astype(np.int32)

  def read(self, start: int, stop: int, out: np.ndarray, counts: bool = False) -> None:
    """Copies tokens (or byte counts) ``[start, stop)`` into ``out``, of their dtype."""
    cuts = [start] + [b for b in self._base if start < b < stop] + [stop]
    self.gather(cuts[:-1], [b - a for a, b in zip(cuts, cuts[1:])], out, counts)

  def gather(self, starts: list[int], lengths: list[int], out: np.ndarray,
             counts: bool = False) -> None:
    """Copies the ranges ``[start, start + length)`` (none across shards) back to back."""
    arrays, base, at = self.byte_counts if counts else self.shards, self._base, 0
    for start, length in zip(starts, lengths):
      i = bisect.bisect_right(base, start) - 1
      part, local = arrays[i], start - base[i]
      if isinstance(part, FileArray):
        part.read_into(local, out[at:at + length])
      else:
        out[at:at + length] = part[local:local + length]
      at += length


class FileArray:
  """A 1-D array in a file whose slices are read with ``pread``.

  Nothing is mapped into the process: what it reads stays in the kernel's
  page cache, not in its resident memory, however much of the file it reads
  (pages of a memory map would count as its own until released).
  """

  def __init__(self, path: str, dtype: str, count: int):
    self.path, self.dtype, self.count = path, np.dtype(dtype), count
    self._fd = os.open(path, os.O_RDONLY)
    self._finalizer = weakref.finalize(self, os.close, self._fd)

  def __len__(self) -> int:
    return self.count

  def read_into(self, start: int, out: np.ndarray) -> None:
    """Items ``start`` ... into ``out`` (contiguous, of this dtype), one system call."""
    want = out.nbytes
    if os.preadv(self._fd, [out], start * self.dtype.itemsize) != want:
      raise DamagedCorpus(f'{self.path} ended early: {want} bytes at item {start} of its '
                          f'{self.count} did not read (the file changed while this run read '
                          'it: prepare the corpus again)')

  def max(self) -> int:
    """The largest item, read in bounded pieces; remembered per file, size and mtime."""
    info = os.fstat(self._fd)
    key = (self.path, info.st_ino, info.st_size, info.st_mtime_ns)
    if key not in _MAX_ITEMS:
      top, buffer = 0, np.empty(min(self.count, SCAN_ITEMS), self.dtype)
      for start in range(0, self.count, SCAN_ITEMS):
        part = buffer[:min(SCAN_ITEMS, self.count - start)]
        self.read_into(start, part)
        top = max(top, int(part.max()))
      _MAX_ITEMS[key] = top
    return _MAX_ITEMS[key]


_MAX_ITEMS = {}  # FileArray.max of the files this process read (evaluate reads them twice)


class DamagedCorpus(config_lib.ConfigError):
  """A prepared corpus's files are not what its manifest says: one line, exit status 2."""


def _split_stream(tokens, counts, bounds, split: int) -> tuple[Stream, Stream]:
  """(the first ``split`` tokens, the rest) of one in-memory stream."""
  train = np.concatenate([bounds[bounds < split], [split]])
  held = np.concatenate([[0], bounds[bounds > split] - split])
  eval_counts = None if counts is None else [counts[split:]]
  return Stream([tokens[:split]], train), Stream([tokens[split:]], held, eval_counts)


@dataclasses.dataclass(frozen=True)
class Data:
  """What a run trains and evaluates on (see the module docstring)."""
  train: tuple[Stream, ...]   # the corpora of the mixture (one but for a mixture)
  weights: tuple[float, ...]  # each corpus's share of the training sequences
  eval: Stream                # the held-out documents the evals score
  shuffled: bool              # prepared: documents, then sequences, shuffled; else windows
  byte_level: bool            # tokens < BYTE_VOCAB are bytes (bits per byte without counts)
  eos_id: int | None
  description: str
  identity: dict              # what defines the training batches (a resume must match)

  @property
  def train_tokens(self) -> int:
    return sum(s.num_tokens for s in self.train)


def load(data_cfg: DataConfig, vocab_size: int, seed: int) -> Data:
  """Reads ``data.path`` (and ``data.eval_path``); raises ValueError naming the problem."""
  path = data_cfg.path
  if path and (',' in path or os.path.isfile(os.path.join(path, MANIFEST))):
    return _load_prepared(data_cfg, vocab_size)
  if data_cfg.weights:
    raise ValueError(f'data.weights={data_cfg.weights!r} weighs the corpora of a mixture, '
                     f'but data.path={path!r} is not prepared corpora')
  data = _load_in_memory(data_cfg, vocab_size, seed)
  if data_cfg.eval_path:
    held = open_prepared(data_cfg.eval_path, 'eval', 'data.eval_path')
    _check_tokenizer(held[0], data_cfg, vocab_size, 'data.eval_path')
    check_ids(held[1], vocab_size, 'data.eval_path', data_cfg.eval_path)
    data = dataclasses.replace(data, eval=held[1], description=(
        data.description + f'; held-out: {data_cfg.eval_path}'))
  return data


def _load_in_memory(data_cfg: DataConfig, vocab_size: int, seed: int) -> Data:
  """The embedded corpus, text, token files or synthetic tokens; the tail held out."""
  path, spec = data_cfg.path, data_cfg.tokenizer
  tok = tokenizer_lib.load(spec)
  if spec or not (path == 'synthetic' or path.endswith(('.npy', '.bin'))):  # text data
    tokenizer_lib.check_vocab(tok, vocab_size)
  byte_level, eos, counts = tok.byte_level, tok.eos_id, None
  if path == '':
    files = default_corpus_files()
    tokens, counts, lengths = _read_text(files, tok)
    desc = f'embedded corpus: {len(files)} files from {os.path.dirname(os.__file__)}'
  elif path == 'synthetic':
    tokens = np.random.default_rng(seed).integers(0, vocab_size, size=1 << 22, dtype=np.int32)
    byte_level, eos, desc, lengths = False, None, 'synthetic random tokens', [1 << 22]
  elif path.endswith(('.npy', '.bin')):
    tokens, top = _map_token_file(path, data_cfg.bin_dtype, vocab_size)
    byte_level = not spec and top < TOKENIZER_VOCAB <= vocab_size
    eos, lengths = EOS_ID if byte_level else None, [len(tokens)]
    desc = f'token file {path}' + (', byte-level (every id below 257)' if byte_level else '')
  else:
    files = glob_files(path, 'data.path=', '*.txt', f' that is not a prepared corpus (no '
                       f'{MANIFEST}: python -m trainer.prepare writes one)')
    tokens, counts, lengths = _read_text(files, tok)
    desc = f'{len(files)} text file(s) from {path}'
  if counts is not None and not tok.byte_level:
    desc += f', tokenized with {tok.name}' + (
        '' if eos is not None else ' (it has no end-of-document token: documents are '
        'told apart by their boundaries alone)')
  if counts is not None and tokens.size and int(tokens.max()) >= vocab_size:
    raise ValueError(f'data.path={path!r} has token id {int(tokens.max())} >= '
                     f'model.vocab_size={vocab_size}')
  if not 0 < data_cfg.eval_fraction < 1:
    raise ValueError(f'data.eval_fraction={data_cfg.eval_fraction} is not in (0, 1)')
  split = int(len(tokens) * (1 - data_cfg.eval_fraction))
  train, held = _split_stream(tokens, None if byte_level else counts, bounds_of(lengths), split)
  # The split moves with the token count (tokenizer, bin_dtype) and eval_fraction: a resume
  # with either changed would train on tokens held out before, at other window offsets.
  identity = {'path': path, 'sampling': 'windows', 'tokens': int(len(tokens)),
              'eval_fraction': data_cfg.eval_fraction}
  return Data((train,), (1.0,), held, False, byte_level, eos, desc, identity)


def glob_files(pattern: str, what: str, example: str, note: str = '') -> list[str]:
  """The files ``pattern`` matches, sorted; ValueError naming ``what`` for none or a directory."""
  files = sorted(glob.glob(pattern))
  if not files:
    raise ValueError(f'{what}{pattern!r} matches no file')
  folders = [f for f in files if os.path.isdir(f)]
  if folders:
    raise ValueError(f'{what}{pattern!r} names a directory ({folders[0]}){note}: name files, '
                     f'e.g. {os.path.join(folders[0], example)}')
  for f in files:  # before anything opens them: a FIFO would block, a device never end
    files_lib.check_regular(f, f'{what}{pattern!r} names ')
  return files


def _read_text(files: list[str], tok):
  docs = []
  for name in files:
    with open(name, 'rb') as f:
      raw = f.read()
    docs.append(raw if tok.byte_level else tokenizer_lib.decode_utf8(raw, name)[0])
  if not sum(len(d) for d in docs):
    raise ValueError(f'corpus is empty: {len(files)} file(s), 0 bytes')
  return encode_documents(docs, tok)


def _map_token_file(path: str, bin_dtype: str, vocab_size: int) -> tuple[np.ndarray, int]:
  """(a ``.npy`` or raw ``.bin`` token array, memory-mapped (never read whole), a bound
  on its ids: the largest, where its dtype could hold one past the vocabulary)."""
  if not os.path.isfile(path):
    raise ValueError(f'data.path={path!r} ' + ('is not a file' if os.path.exists(path)
                                                else 'does not exist'))
  if path.endswith('.npy'):
    tokens = np.load(path, mmap_mode='r', allow_pickle=False)
  else:
    if bin_dtype not in ('uint16', 'uint32'):
      raise ValueError(f'data.bin_dtype={bin_dtype!r} is not uint16 or uint32')
    if bin_dtype == 'uint16' and vocab_size > 2**16:  # read as uint16, uint32 ids look valid
      raise ValueError(f"data.bin_dtype='uint16' holds ids < 65536 but model.vocab_size="
                       f'{vocab_size}: its .bin holds uint32 ids (set data.bin_dtype=uint32)')
    tokens = np.memmap(path, dtype=bin_dtype, mode='r')
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f'data.path={path!r} is not a 1-D integer token array')
  if not tokens.size:
    raise ValueError(f'corpus is empty: {path} has 0 tokens')
  signed = np.iinfo(tokens.dtype).min < 0  # padding such as -100 must not train as a token
  top = int(np.iinfo(tokens.dtype).max)
  if signed or top >= vocab_size:  # a pass over the file, in chunks
    chunks = [tokens[i:i + (1 << 24)] for i in range(0, tokens.size, 1 << 24)]
    low, top = zip(*((int(c.min()) if signed else 0, int(c.max())) for c in chunks))
    if min(low) < 0:
      raise ValueError(f'data.path={path!r} has token id {min(low)} < 0')
    top = max(top)
    if top >= vocab_size:
      raise ValueError(f'data.path={path!r} has token id {top} >= '
                       f'model.vocab_size={vocab_size}')
  return tokens, top


# ------------------------------------------------------------ prepared corpora

def read_manifest(path: str, what: str = 'data.path') -> dict:
  """The manifest of the prepared corpus in directory ``path``; ValueError if there is none."""
  file = os.path.join(path, MANIFEST)
  if not os.path.isdir(path):
    raise ValueError(f'{what}={path!r} ' + ('is not a directory' if os.path.exists(path)
                                             else 'does not exist') + ' (a prepared corpus '
                     'is a directory written by python -m trainer.prepare)')
  if not os.path.isfile(file):
    raise ValueError(f'{what}={path!r} has no {MANIFEST}: not a prepared corpus, or its '
                     'preparation did not finish (run python -m trainer.prepare again)')
  try:
    with open(file, encoding='utf-8') as f:
      manifest = json.load(f)
  except ValueError as e:
    raise ValueError(f'{what}={path!r}: {file} is not valid JSON ({e})') from None
  if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
    raise ValueError(f'{what}={path!r}: {file} is not a {FORMAT} manifest')
  return manifest


def open_prepared(path: str, split: str, what: str = 'data.path') -> tuple[dict, Stream]:
  """(manifest, the ``split`` documents as a Stream of shards read from disk)."""
  manifest = read_manifest(path, what)
  info = manifest['splits'][split]
  if not info['tokens']:
    raise ValueError(f'{what}={path!r} has no {"held-out" if split == "eval" else split} '
                     f'documents (see its {MANIFEST})')
  shards, counts, bounds = [], [], [[0]]
  with_counts = split == 'eval' and not manifest['tokenizer']['byte_level']
  for shard in info['shards']:
    name, n, dtype = shard['name'], shard['tokens'], manifest['dtype']
    shards.append(FileArray(_file(path, name + '.bin', dtype, n, what), dtype, n))
    index = np.fromfile(_file(path, name + '.idx', 'int64', shard['documents'] + 1, what),
                        np.int64)
    if index[0] != 0 or index[-1] != n or not np.all(np.diff(index) > 0):
      raise ValueError(f'{what}={path!r} is damaged: {name}.idx is not document boundaries '
                       f'rising from 0 to {n}, the tokens its {MANIFEST} says')
    bounds.append(index[1:] + bounds[-1][-1])
    if with_counts:
      counts.append(FileArray(_file(path, name + '.bytes', 'int32', n, what), 'int32', n))
  return manifest, Stream(shards, np.concatenate(bounds), counts if with_counts else None)


def _file(path: str, name: str, dtype: str, count: int, what: str) -> str:
  """The path of file ``name`` if it holds ``count`` items of ``dtype``; else ValueError."""
  file = os.path.join(path, name)
  found = files_lib.kind(file)
  size = os.path.getsize(file) if found is None else None
  if size != count * np.dtype(dtype).itemsize:
    raise DamagedCorpus(f'{what}={path!r} is damaged: {name} ' + (
        'is missing' if found == 'missing' else f'is {found}, not a regular file'
        if found else f'has {size} bytes, its {MANIFEST} says {count * np.dtype(dtype).itemsize}'))
  return file


def _load_prepared(data_cfg: DataConfig, vocab_size: int) -> Data:
  paths = [p.strip() for p in data_cfg.path.split(',')]
  weights = parse_weights(data_cfg.weights, len(paths))
  corpora = [open_prepared(p, 'train') for p in paths]
  first = corpora[0][0]['tokenizer']
  for p, (manifest, stream) in zip(paths, corpora):
    _check_tokenizer(manifest, data_cfg, vocab_size, 'data.path', p)
    check_ids(stream, vocab_size, 'data.path', p)
  if not weights:
    weights = [s.num_tokens for _, s in corpora]
  given = data_cfg.eval_path
  if not given and len(paths) > 1:
    raise ValueError(f"data.eval_path='' but data.path is a mixture of {len(paths)} corpora: "
                     'name the prepared corpus whose held-out documents to score')
  eval_path = given or paths[0]
  what = 'data.eval_path' if given else 'data.path'
  held_manifest, held = open_prepared(eval_path, 'eval', what)
  _check_tokenizer(held_manifest, data_cfg, vocab_size, what, eval_path)
  check_ids(held, vocab_size, what, eval_path)
  total = sum(weights)
  shares = tuple(w / total for w in weights)
  desc = ', '.join(f'{p} ({s:.0%})' if len(paths) > 1 else p for p, s in zip(paths, shares))
  desc = f'prepared corpus {desc}, held-out: {eval_path}, tokenizer {first["name"]}'
  identity = {'sources': [m['fingerprint'] for m, _ in corpora], 'weights': list(shares),
              'sampling': 'shuffled sequences'}
  return Data(tuple(s for _, s in corpora), shares, held, True, first['byte_level'],
              first['eos_id'], desc, identity)


def parse_weights(text: str, count: int) -> list[float]:
  """``data.weights``: one positive number per corpus ('': by their sizes).

  Their sum must be finite too (1e308,1e308 is not): each corpus's share is its
  weight divided by it.
  """
  if not text:
    return []
  try:
    weights = [float(w) for w in text.split(',')]
  except ValueError:
    weights = []
  if len(weights) != count or not all(math.isfinite(w) and w > 0 for w in weights):
    raise ValueError(f'data.weights={text!r} is not {count} positive number(s) separated by '
                     f'commas, one per corpus of data.path')
  if not math.isfinite(sum(weights)):
    raise ValueError(f'data.weights={text!r} add up to more than a float holds: scale '
                     'them down (only their ratios matter)')
  return weights


def check_ids(stream: Stream, vocab_size: int, what: str, path: str) -> None:
  """Every token id of a prepared split is below ``vocab_size`` (a scan of each shard).

  The manifest's vocabulary is checked first (_check_tokenizer); this catches
  shards or a manifest changed since: an id past the embedding ends in a NaN loss.
  """
  for shard in stream.shards:
    top = shard.max()
    if top >= vocab_size:
      raise DamagedCorpus(f'{what}={path!r}: {os.path.basename(shard.path)} holds token id '
                          f'{top} >= model.vocab_size={vocab_size} (changed since '
                          f'python -m trainer.prepare wrote it, or its {MANIFEST} was)')


def _check_tokenizer(manifest: dict, data_cfg: DataConfig, vocab_size: int, what: str,
                     path: str | None = None) -> None:
  """The corpus was tokenized as ``data.tokenizer`` says, into ids the model has."""
  tok = manifest['tokenizer']
  path = path or data_cfg.eval_path
  name = "'' (byte-level)" if tok['byte_level'] else repr(tok['path'])
  if tok['vocab_size'] > vocab_size:
    raise ValueError(f'{what}={path!r} was tokenized with {name} ({tok["vocab_size"]} tokens) '
                     f'but model.vocab_size={vocab_size}: the vocabularies do not match')
  spec = data_cfg.tokenizer
  if tok['byte_level'] and not spec:
    return
  same = (not tok['byte_level'] and spec and
          file_sha256(tokenizer_lib.resolve(spec)) == tok['sha256'])
  if not same:
    raise ValueError(f'{what}={path!r} was tokenized with {name}, not data.tokenizer='
                     f'{spec!r}: set --config.data.tokenizer={tok["path"] or chr(39) * 2}')


def file_sha256(path: str) -> str:
  """The SHA-256 of a file's bytes, in hex (which tokenizer a corpus was prepared with)."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      digest.update(chunk)
  return digest.hexdigest()


def check_lengths(data: Data, seq_len: int, batch_size: int, eval_steps: int) -> None:
  """Raises ValueError if the streams cannot fill the requested batches."""
  for stream in data.train:
    if stream.num_tokens < seq_len + 1:
      raise ValueError(f'training split has {stream.num_tokens} tokens, fewer '
                       f'than seq_len+1={seq_len + 1}')
  need = eval_steps * batch_size * seq_len + 1
  if data.eval.num_tokens < need:
    fits = eval_batches(data, batch_size, seq_len)
    fix = (f'set --config.eval_steps={fits} (the most it fills)' if fits else
           'hold out more (python -m trainer.prepare --eval_tokens, or data.eval_fraction), '
           'or lower batch_size or seq_len')
    raise ValueError(f'held-out split has {data.eval.num_tokens} tokens; eval_steps='
                     f'{eval_steps} x batch_size={batch_size} x seq_len={seq_len} '
                     f'needs {need}: {fix}')


def eval_batches(data: Data, batch_size: int, seq_len: int) -> int:
  """How many held-out batches of ``batch_size`` x ``seq_len`` the held-out split fills."""
  return (data.eval.num_tokens - 1) // (batch_size * seq_len)


def main(argv=None) -> None:
  """``python -m trainer.data``: the embedded corpus and its reference compressors."""
  argparse.ArgumentParser(
      prog='python -m trainer.data',
      description='The default corpus of configs/default.py: its size, split, and the bits per '
                  'byte gzip -9 and xz -9e reach on its held-out text (the references make '
                  'train prints beside each eval).'
  ).parse_args(argv)
  cfg = config_lib.load(os.path.join(os.path.dirname(__file__), '..', 'configs', 'default.py'))
  data = load(cfg.data, cfg.model.vocab_size, cfg.seed)
  held = data.eval.tokens()
  n_eval = cfg.eval_steps * cfg.batch_size * cfg.seq_len
  whole = compression.scored_bytes(held)
  scored = compression.held_out_bytes(data.eval, n_eval)
  print(data.description)
  print(f'train tokens {data.train_tokens:,}  held-out tokens {len(held):,}')
  for key, (name, _) in compression.COMPRESSORS.items():
    print(f'{name}, whole held-out text ({math.ceil(len(whole) / 1024)} KiB): '
          f'{compression.bits_per_byte(whole, key):.3f} bits per byte')
    print(f'{name}, the {len(scored):,} held-out bytes the default eval scores: '
          f'{compression.bits_per_byte(scored, key):.3f} bits per byte')


if __name__ == '__main__':
  main()
