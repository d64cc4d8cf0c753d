r"""Tokenizes a text corpus once into token shards that training reads lazily.

  python -m trainer.prepare --input 'corpus/*.jsonl' [more files or globs ...] \
      --output data/mycorpus [--tokenizer SPEC] [--text_field text] \
      [--eval_fraction 0.01] [--eval_tokens 131073] [--workers N] [--shard_size_mb 512]
      [--errors strict]

Inputs, by name: ``.jsonl`` / ``.ndjson`` (one JSON object per line, the text in
``--text_field``), ``.parquet`` (the ``--text_field`` column; needs the
``data`` extra, pyarrow), anything else: a text file, one document. Documents
are tokenized with ``--tokenizer`` (what ``data.tokenizer`` accepts: '' bytes,
a tokenizer.json, a SentencePiece .model, a directory holding one), each
followed by its end-of-document token, in ``--workers`` processes, with a
progress line on stderr. A document goes to the held-out split when a hash of
its text falls below ``--eval_fraction``: the split does not depend on the
order of the inputs or the number of workers, and duplicates land together.
Should those documents hold fewer than ``--eval_tokens`` tokens (a small corpus,
or one of few long documents), the limit rises to the next documents by hash
until they do (at most half the corpus's tokens, unless the first document
alone holds more; one document always trains):
the pieces of work with such documents are tokenized again.

Only regular files are read (a FIFO, a device or a socket is refused before it
is opened). A tokenizer other than bytes reads UTF-8: a byte sequence that is
not, or half a surrogate pair in JSON, stops the run naming the file and the
byte (``--errors=replace`` replaces them instead, counted in the summary and in
``corpus.json``'s ``replaced``; the byte-level tokenizer takes any bytes). Memory
stays bounded whatever a document's size: a text file of more than
``PIECE_BYTES`` (4 MiB; other tokenizers: ``PIECE_CHARS``, 256 Ki characters)
is read and tokenized in pieces of about that size (byte-level: the same
tokens; other tokenizers: pieces cut where their pre-tokenizers cut, see
``_cut``); a JSONL or Parquet document is held whole as text, its tokens in
pieces. Documents are tokenized in batches of at most that size.

The output directory (layout: trainer/data.py) holds ``train-NNNNN.bin`` token
shards of about ``--shard_size_mb`` each with ``.idx`` document boundaries, the
held-out ``eval-NNNNN`` shards apart, and ``corpus.json``, written last: until
it is there nothing in the directory is a corpus. Work goes to ``DIR/.work``
first; running the same command again after an interruption finishes it
(pieces already done are kept), and once finished is a no-op. Bad input
(missing files, an empty corpus, a text field the inputs lack, an unreadable
tokenizer) exits 2 with one line ``error: ...``, nothing written.

Then: ``python -m trainer.train --config configs/default.py --config.data.path=DIR``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import multiprocessing
import os
import re
import shlex
import shutil
import sys
import time

import numpy as np

from trainer import data as data_lib
from trainer import files as files_lib
from trainer import hints, tokenizer as tokenizer_lib

UNIT_BYTES = 32 << 20  # input bytes per piece of work (a worker's task)
DOCS_PER_CALL = 1024   # documents tokenized per call, at most
# What one call tokenizes, about (a document of more is tokenized in pieces): bounds the
# memory. Bytes of a file read at once, and the byte-level tokenizer's ids per call; other
# tokenizers' characters per call (the tokenizers library takes some 300 bytes a token,
# and a small vocabulary makes up to a token a character).
PIECE_BYTES = 4 << 20
PIECE_CHARS = 1 << 18
WORK = '.work'
JSONL = ('.jsonl', '.ndjson')
EVAL_TOKENS = 32 * 16 * 256 + 1  # evaluate --config.eval_steps=32 on the default config


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m trainer.prepare', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--input', nargs='+', required=True, help='files or globs (quote globs)')
  p.add_argument('--output', required=True, help='directory to write the corpus to')
  p.add_argument('--tokenizer', default='', help="'' bytes (default), or a tokenizer "
                 'file or directory (see trainer/tokenizer.py)')
  p.add_argument('--text_field', default='text', help='JSONL key / Parquet column of the text')
  p.add_argument('--eval_fraction', type=float, default=0.01,
                 help='share of documents held out (default 0.01; 0: none)')
  p.add_argument('--eval_tokens', type=int, default=EVAL_TOKENS,
                 help='held out: at least this many tokens, in whole documents, when '
                 '--eval_fraction > 0 (default %(default)s: 32 eval batches of the default '
                 "config's 16 x 256 tokens; at most half the corpus's; 0: the fraction alone)")
  p.add_argument('--workers', type=int, default=os.cpu_count() or 1,
                 help='tokenizing processes (default: one per CPU)')
  p.add_argument('--shard_size_mb', type=float, default=512, help='token shard size (MiB)')
  p.add_argument('--errors', choices=tokenizer_lib.UTF8_ERRORS, default='strict',
                 help='text a tokenizer cannot read (bytes that are not UTF-8, half a '
                 'surrogate pair): strict (default) stops naming the file and byte; '
                 'replace replaces it (U+FFFD, ?) and reports how much')
  return p.parse_args(argv)


# ------------------------------------------------------------------ checks

def expand(patterns: list[str]) -> list[str]:
  """The files ``patterns`` name, each pattern sorted, in order; ValueError if one names none."""
  files = {}  # ordered, without repeats
  for pattern in patterns:
    files.update(dict.fromkeys(data_lib.glob_files(pattern, '--input ', '*.jsonl')))
  return list(files)


def kind_of(path: str) -> str:
  return 'jsonl' if path.endswith(JSONL) else 'parquet' if path.endswith('.parquet') else 'text'


def check_inputs(files: list[str], field: str) -> None:
  """Raises ValueError for an empty corpus or a text field the inputs lack."""
  if not sum(os.path.getsize(f) for f in files):
    raise ValueError(f'corpus is empty: {len(files)} file(s), 0 bytes')
  for path in files:
    if kind_of(path) == 'jsonl':
      with open(path, 'rb') as f:
        line = next((l for l in f if l.strip()), b'')
      _text_of(_json(line, path, 0), field, path, 0)
    elif kind_of(path) == 'parquet':
      names = _parquet().ParquetFile(path).schema_arrow.names
      if field not in names:
        raise ValueError(f'--text_field={field!r}: {path} has no such column (its columns: '
                         f'{", ".join(names)})')


def _parquet():
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f'Parquet input needs pyarrow: {hints.install_hint("data")}') from None
  return pq


def _json(line: bytes, path: str, offset: int, errors: str = 'replace', stats=None):
  """The JSON object on ``line``; its bytes decoded as ``--errors`` says (counted in ``stats``)."""
  line, replaced = tokenizer_lib.decode_utf8(line, path, offset, errors)
  if stats is not None:
    stats['replaced'] += replaced
  try:
    record = json.loads(line)
  except ValueError as e:
    raise ValueError(f'{path} at byte {offset}: not a JSON line ({e})') from None
  if not isinstance(record, dict):
    raise ValueError(f'{path} at byte {offset}: not a JSON object')
  return record


def _text_of(record: dict, field: str, path: str, offset: int) -> str:
  if field not in record:
    raise ValueError(f'--text_field={field!r}: {path} at byte {offset} has no such field '
                     f'(its fields: {", ".join(map(str, record))})')
  text = record[field]
  if text is not None and not isinstance(text, str):
    raise ValueError(f'--text_field={field!r}: {path} at byte {offset} holds a '
                     f'{type(text).__name__}, not text')
  return text or ''


# ------------------------------------------------------------------- plan

def plan(files: list[str]) -> list[dict]:
  """Pieces of work in input order: byte ranges of JSONL, row groups, runs of text files."""
  units, texts, size = [], [], 0
  for path in files + [None]:  # None: the end
    kind = kind_of(path) if path else None
    if texts and (kind != 'text' or size >= UNIT_BYTES):
      units.append({'kind': 'text', 'files': texts, 'bytes': size})
      texts, size = [], 0
    if kind == 'text':
      texts.append(path)
      size += os.path.getsize(path)
    elif kind == 'jsonl':
      end = os.path.getsize(path)
      units += [{'kind': kind, 'file': path, 'start': a, 'stop': min(end, a + UNIT_BYTES),
                 'bytes': min(end, a + UNIT_BYTES) - a} for a in range(0, end, UNIT_BYTES)]
    elif kind == 'parquet':
      units += _row_group_units(path)
  return units


def _row_group_units(path: str) -> list[dict]:
  meta = _parquet().ParquetFile(path).metadata
  units, groups, size = [], [], 0
  for i in range(meta.num_row_groups):
    groups.append(i)
    size += meta.row_group(i).total_byte_size
    if size >= UNIT_BYTES or i == meta.num_row_groups - 1:
      units.append({'kind': 'parquet', 'file': path, 'groups': groups, 'bytes': size})
      groups, size = [], 0
  return units


def fingerprint(files: list[str], args, tok) -> dict:
  """What the output depends on: equal fingerprints, equal corpora."""
  inputs = [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]
  tokenizer = ('bytes' if tok.byte_level else
               data_lib.file_sha256(tokenizer_lib.resolve(args.tokenizer)))
  # --errors=strict writes what replace does, or nothing: corpora before the flag match.
  return {'format': data_lib.FORMAT, 'inputs': inputs, 'tokenizer': tokenizer,
          'text_field': args.text_field, 'eval_fraction': args.eval_fraction,
          'eval_tokens': args.eval_tokens,
          'unit_bytes': UNIT_BYTES, 'shard_size_mb': args.shard_size_mb,
          **({'errors': args.errors} if args.errors != 'strict' else {})}


# ----------------------------------------------------------------- workers

_TOKENIZER = {}


def _documents(unit: dict, field: str, limit: int, errors: str, stats: dict):
  """The unit's documents as (where, document): bytes or, when larger than ``limit``, a
  _LargeFile (text files), or str."""
  if unit['kind'] == 'text':
    for path in unit['files']:
      if os.path.getsize(path) > limit:
        yield path, _LargeFile(path)
        continue
      with open(path, 'rb') as f:
        yield path, f.read()
  elif unit['kind'] == 'jsonl':
    with open(unit['file'], 'rb') as f:
      f.seek(max(unit['start'] - 1, 0))
      if unit['start']:
        f.readline()  # the line that began before the unit belongs to the previous one
      while f.tell() < unit['stop']:
        offset, line = f.tell(), f.readline()
        if line.strip():
          where = f'{unit["file"]} at byte {offset}'
          record = _json(line, unit['file'], offset, errors, stats)
          yield where, _text_of(record, field, unit['file'], offset)
  else:
    table = _parquet().ParquetFile(unit['file']).read_row_groups(unit['groups'], columns=[field])
    for text in table.column(0).to_pylist():
      if text is not None and not isinstance(text, str):
        raise ValueError(f'--text_field={field!r}: {unit["file"]} holds a '
                         f'{type(text).__name__}, not text')
      yield unit['file'], text or ''


class _LargeFile:
  """A large text file, read in pieces of PIECE_BYTES (twice: its hash, its tokens)."""

  def __init__(self, path: str):
    self.path = path

  def chunks(self):
    """(byte offset, bytes) of the file in order."""
    with open(self.path, 'rb') as f:
      offset = 0
      for chunk in iter(lambda: f.read(PIECE_BYTES), b''):
        yield offset, chunk
        offset += len(chunk)

  def digest(self):
    digest = hashlib.blake2b(digest_size=8)
    for _, chunk in self.chunks():
      digest.update(chunk)
    return digest


def held_out(text: bytes, fraction: float) -> bool:
  """Whether a document (its UTF-8 bytes) is held out: a hash of it below ``fraction``
  (before ``--eval_tokens`` raises the limit: hold_out_limit)."""
  return doc_hash(text) < fraction_limit(fraction)


def doc_hash(text: bytes) -> int:
  """A document's place in the hold-out order: a hash of its UTF-8 bytes in [0, 2**64)."""
  return _digest_int(hashlib.blake2b(text, digest_size=8))


def _digest_int(digest) -> int:
  """A blake2b ``digest`` (8 bytes, whole or fed piece by piece) as doc_hash gives it."""
  return int.from_bytes(digest.digest(), 'little')


def fraction_limit(fraction: float) -> int:
  """The hash limit that holds out ``fraction`` of the documents (hashes below it)."""
  return math.ceil(fraction * 2**64)


def hold_out_limit(work_dir: str, count: int, fraction: float, tokens: int) -> int:
  """The hash limit of the held-out documents: ``fraction``'s, raised (documents by hash)
  until they hold ``tokens`` tokens, but not past half the corpus's (unless its first
  document by hash alone holds more); one document stays in training."""
  base = fraction_limit(fraction)
  if not (fraction and tokens):
    return base
  hashes, lengths = [], []
  for i in range(count):
    for split in data_lib.SPLITS:
      stem = os.path.join(work_dir, f'u-{i:05d}-{split}')
      hashes.append(np.fromfile(stem + '.hash', np.uint64))
      lengths.append(np.fromfile(stem + '.len', np.int64))
  hashes, lengths = np.concatenate(hashes), np.concatenate(lengths)
  order = np.argsort(hashes, kind='stable')
  hashes, total = hashes[order], np.cumsum(lengths[order])
  half = total[-1] // 2
  first = int(np.searchsorted(total, min(tokens, half)))  # the first to reach them
  if first > 0 and total[first] > half:  # past half the corpus: the one before it
    first -= 1
  first = min(first, len(hashes) - 2)
  return base if first < 0 else max(base, int(hashes[first]) + 1)


def _below(hashes: np.ndarray, limit: int) -> np.ndarray:
  return hashes < limit if limit < 2**64 else np.ones(hashes.shape, bool)


def _cut(text: str, limit: int) -> int:
  """Where a piece of ``text`` (longer than ``limit`` characters) ends.

  After a newline between two characters that are not whitespace, else before
  a space between two such, the last in the piece's second half; else at its
  end. Pre-tokenizers that split text into words (GPT-2's and Llama 3's
  patterns, Whitespace) split there too, so the tokens equal the whole text's;
  a SentencePiece model or a tokenizer that adds a space in front of its
  input may tokenize a few characters at a cut otherwise.
  """
  window = text[limit // 2:limit]
  for pattern, end in ((_NEWLINE, True), (_SPACE, False)):
    last = None
    for last in pattern.finditer(window):
      pass
    if last:
      return limit // 2 + (last.end() if end else last.start())
  return limit


_NEWLINE = re.compile(r'(?<=\S)\n(?=\S)')
_SPACE = re.compile(r'(?<=\S) (?=\S)')


def _text_pieces(texts, limit: int):
  """The text of ``texts`` (one document's consecutive parts) in pieces cut by ``_cut``."""
  carry = ''
  for text in texts:
    carry += text
    while len(carry) > limit:
      at = _cut(carry, limit)
      yield carry[:at]
      carry = carry[at:]
  if carry:
    yield carry


def _file_texts(doc: _LargeFile, errors: str, stats: dict):
  """The text of a large file in parts, decoded piece by piece (see decode_utf8)."""
  decoder = tokenizer_lib.utf8_decoder(errors)
  offset = 0
  for offset, chunk in doc.chunks():
    text, replaced = tokenizer_lib.decode_utf8(chunk, doc.path, offset, errors, decoder, False)
    stats['replaced'] += replaced
    yield text
  text, replaced = tokenizer_lib.decode_utf8(b'', doc.path, offset, errors, decoder)
  stats['replaced'] += replaced
  yield text


def _payload(doc, where: str, tok, errors: str, stats: dict):
  """(doc_hash of the document's bytes, its size, what to tokenize or its pieces).

  What to tokenize: the bytes (byte-level) or text of a document of at most
  ``_limit(tok)``; a generator of pieces of a larger one, each tokenized apart.
  """
  limit = _limit(tok)
  if isinstance(doc, _LargeFile):
    size = os.path.getsize(doc.path)
    if tok.byte_level:
      return _digest_int(doc.digest()), size, (chunk for _, chunk in doc.chunks())
    return _digest_int(doc.digest()), size, _text_pieces(_file_texts(doc, errors, stats), limit)
  if isinstance(doc, bytes):  # a text file: hashed as it is, decoded for a tokenizer
    raw, text, replaced = doc, None, 0
    if not tok.byte_level:
      text, replaced = tokenizer_lib.decode_utf8(doc, where, 0, errors)
  else:  # JSONL, Parquet: what is hashed is what is tokenized
    raw, replaced = tokenizer_lib.encode_utf8(doc, where, errors)
    text = None if tok.byte_level else (raw.decode('utf-8') if replaced else doc)
  stats['replaced'] += replaced
  digest = doc_hash(raw)
  if len(raw) <= limit:
    return digest, len(raw), raw if tok.byte_level else text
  if tok.byte_level:
    return digest, len(raw), (raw[i:i + limit] for i in range(0, len(raw), limit))
  return digest, len(raw), _text_pieces((text[i:i + limit] for i in range(0, len(text), limit)),
                                        limit)


def _limit(tok) -> int:
  return PIECE_BYTES if tok.byte_level else PIECE_CHARS


def work(index: int, unit: dict, out: str, spec: str, field: str, limit: int,
         dtype: str, errors: str = 'strict') -> dict:
  """Tokenizes one unit into ``out/u-INDEX-{train,eval}.*``; returns its counts.

  Documents whose hash (doc_hash) is below ``limit`` are held out.
  """
  if spec not in _TOKENIZER:
    os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')  # one process per core already
    _TOKENIZER[spec] = tokenizer_lib.load(spec)
  tok = _TOKENIZER[spec]
  writers = {s: _UnitWriter(os.path.join(out, f'u-{index:05d}-{s}'), dtype, s == 'eval'
                            and not tok.byte_level, tok) for s in data_lib.SPLITS}
  batches = {s: [] for s in data_lib.SPLITS}
  sizes = dict.fromkeys(data_lib.SPLITS, 0)
  hashes = {s: [] for s in data_lib.SPLITS}
  stats = {'documents': 0, 'empty': 0, 'bytes': unit['bytes'], 'replaced': 0}

  def flush(split):
    ids, counts, lengths = data_lib.encode_documents(batches[split], tok)
    doc_hashes = np.array(hashes[split], np.uint64)
    batches[split], hashes[split], sizes[split] = [], [], 0
    # Without an end-of-document token, a document can tokenize to nothing (blank text):
    # it has no place in the index (bounds_of), so it is skipped like an empty one.
    nothing = int((lengths == 0).sum())
    stats['documents'] -= nothing
    stats['empty'] += nothing
    writers[split].write(ids, counts, lengths[lengths > 0], doc_hashes[lengths > 0])

  for where, doc in _documents(unit, field, _limit(tok), errors, stats):
    if not doc:
      stats['empty'] += 1
      continue
    digest, size, payload = _payload(doc, where, tok, errors, stats)
    split = 'eval' if digest < limit else 'train'
    stats['documents'] += 1
    if isinstance(payload, (bytes, str)):
      batches[split].append(payload)
      hashes[split].append(digest)
      sizes[split] += size
      if len(batches[split]) == DOCS_PER_CALL or sizes[split] >= _limit(tok):
        flush(split)
      continue
    if batches[split]:
      flush(split)  # the documents before it, first
    if not writers[split].write_pieces(payload, digest):
      stats['documents'] -= 1
      stats['empty'] += 1
  for split, writer in writers.items():
    if batches[split]:
      flush(split)
    stats[split] = writer.close()
  _write_json(os.path.join(out, f'u-{index:05d}.json'), stats)  # last: the unit is done
  return stats


class _UnitWriter:
  """Appends one split's tokens, document lengths and (held out) byte counts."""

  def __init__(self, stem: str, dtype: str, counts: bool, tok):
    self.stem, self.dtype, self.tok, self.tokens, self.text_bytes = stem, dtype, tok, 0, 0
    self.files = {'bin': open(stem + '.bin', 'wb'), 'len': open(stem + '.len', 'wb'),
                  'hash': open(stem + '.hash', 'wb')}
    if counts:
      self.files['bytes'] = open(stem + '.bytes', 'wb')

  def write_pieces(self, pieces, doc_hash: int) -> int:
    """Writes one document (its hash ``doc_hash``) tokenized piece by piece, then its end;
    returns its length."""
    length = 0
    for piece in pieces:
      (ids, counts), = self.tok.encode_documents([piece])
      self.write(ids, counts, np.zeros(0, np.int64), np.zeros(0, np.uint64))
      length += len(ids)
    eos = [] if self.tok.eos_id is None else [self.tok.eos_id]
    length += len(eos)
    self.write(np.array(eos, np.int32), np.full(len(eos), -1, np.int32),
               np.array([length] if length else [], np.int64),
               np.array([doc_hash] if length else [], np.uint64))
    return length

  def write(self, ids: np.ndarray, counts: np.ndarray, lengths: np.ndarray,
            hashes: np.ndarray) -> None:
    if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:  # astype would wrap it
      raise ValueError(f'tokenizer {self.tok.name} gave token id {int(ids.max())}, more than '
                       f'the corpus dtype {self.dtype} holds (its vocab_size is '
                       f'{self.tok.vocab_size})')
    self.files['bin'].write(ids.astype(self.dtype).tobytes())
    self.files['len'].write(lengths.astype(np.int64).tobytes())
    self.files['hash'].write(hashes.tobytes())  # each document's (hold_out_limit)
    if 'bytes' in self.files:
      self.files['bytes'].write(counts.astype(np.int32).tobytes())
    self.tokens += len(ids)
    self.text_bytes += int(counts[counts > 0].sum())

  def close(self) -> dict:
    for f in self.files.values():
      f.close()
    return {'tokens': self.tokens, 'text_bytes': self.text_bytes,
            'documents': os.path.getsize(self.stem + '.len') // 8}


def _write_json(path: str, obj) -> None:
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    json.dump(obj, f, indent=1)
  os.replace(path + '.tmp', path)


# ---------------------------------------------------------------- the run

def run_units(units: list[dict], files: list[str], work_dir: str, args,
              dtype: str, limit: int) -> list[dict]:
  """Tokenizes the units not done yet in ``args.workers`` processes, holding out the
  documents whose hash is below ``limit``; returns every unit's counts."""
  done = {}
  for i in range(len(units)):
    path = os.path.join(work_dir, f'u-{i:05d}.json')
    if os.path.isfile(path):
      with open(path, encoding='utf-8') as f:
        done[i] = json.load(f)
  progress = Progress(units, done)
  todo = [i for i in range(len(units)) if i not in done]
  if todo:
    with concurrent.futures.ProcessPoolExecutor(
        min(args.workers, len(todo)), mp_context=multiprocessing.get_context('spawn')) as pool:
      futures = {pool.submit(work, i, units[i], work_dir, args.tokenizer, args.text_field,
                             limit, dtype, args.errors): i for i in todo}
      try:
        for future in concurrent.futures.as_completed(futures):
          done[futures[future]] = future.result()
          progress.update(done)
      except BaseException:
        for future in futures:
          future.cancel()
        raise
  if not sum(s['train']['tokens'] + s['eval']['tokens'] for s in done.values()):
    raise ValueError(f'corpus is empty: {len(files)} file(s) hold no text')
  progress.finish(done)
  return [done[i] for i in range(len(units))]


class Progress:
  """One line on stderr: units, input bytes, rate, documents, tokens, time left."""

  def __init__(self, units: list[dict], done: dict):
    self.total = sum(u['bytes'] for u in units)
    self.units, self.start = len(units), time.time()
    self.printed = self.start
    self.before = sum(s['bytes'] for s in done.values())  # done by an earlier run
    self.live = sys.stderr.isatty()

  def update(self, done: dict, final: bool = False) -> None:
    now = time.time()
    if not (self.live or final or now - self.printed >= 10):
      return
    self.printed = now
    read = sum(s['bytes'] for s in done.values())
    rate = (read - self.before) / max(now - self.start, 1e-9)
    left = (self.total - read) / rate if rate > 0 else 0
    tokens = sum(s[x]['tokens'] for s in done.values() for x in data_lib.SPLITS)
    line = (f'prepare: {len(done)}/{self.units} pieces, {_mib(read)} of {_mib(self.total)} '
            f'({_mib(rate)}/s), {sum(s["documents"] for s in done.values()):,} documents, '
            f'{tokens:,} tokens, ' + ('done' if final else f'{left:.0f} s left'))
    sys.stderr.write(('\r\x1b[2K' + line + ('\n' if final else '')) if self.live else line + '\n')
    sys.stderr.flush()

  def finish(self, done: dict) -> None:
    self.update(done, final=True)


def _mib(n: float) -> str:
  return f'{n / 2**20:,.1f} MiB'


def assemble(out: str, work_dir: str, stats: list[dict], shard_bytes: int, dtype: str,
             counts: bool) -> dict:
  """Concatenates the units' pieces into shards; returns the manifest's ``splits``."""
  splits = {}
  for split in data_lib.SPLITS:
    shards, pieces, size = [], [], 0
    for i, s in enumerate(stats):
      if not s[split]['tokens']:
        continue
      pieces.append(i)
      size += s[split]['tokens'] * np.dtype(dtype).itemsize
      if size >= shard_bytes:
        shards.append(_shard(out, work_dir, split, len(shards), pieces, stats, counts))
        pieces, size = [], 0
    if pieces:
      shards.append(_shard(out, work_dir, split, len(shards), pieces, stats, counts))
    splits[split] = {'shards': shards, **{k: sum(s[split][k] for s in stats)
                                           for k in ('tokens', 'documents', 'text_bytes')}}
  return splits


def _shard(out, work_dir, split, number, pieces, stats, counts) -> dict:
  """Writes shard ``number`` of ``split`` from the units ``pieces``."""
  name = f'{split}-{number:05d}'
  suffixes = ['bin'] + (['bytes'] if counts and split == 'eval' else [])
  for suffix in suffixes:
    with open(os.path.join(out, f'{name}.{suffix}'), 'wb') as dst:
      for i in pieces:
        with open(os.path.join(work_dir, f'u-{i:05d}-{split}.{suffix}'), 'rb') as src:
          shutil.copyfileobj(src, dst, 16 << 20)
  lengths = [np.fromfile(os.path.join(work_dir, f'u-{i:05d}-{split}.len'), np.int64)
             for i in pieces]
  data_lib.bounds_of(np.concatenate(lengths)).tofile(os.path.join(out, f'{name}.idx'))
  return {'name': name, 'tokens': sum(stats[i][split]['tokens'] for i in pieces),
          'documents': sum(stats[i][split]['documents'] for i in pieces)}


def output_state(out: str, source: dict) -> str:
  """'done' (prepared from ``source``), 'resume', or 'new'; ValueError if ``out`` is another's."""
  manifest = os.path.join(out, data_lib.MANIFEST)
  plan_file = os.path.join(out, WORK, 'plan.json')
  if os.path.isfile(manifest):
    with open(manifest, encoding='utf-8') as f:
      if json.load(f).get('source') == source:
        return 'done'
    raise ValueError(f'--output {out} holds a corpus prepared from other input or options: '
                     'use another directory, or delete it to prepare this one there')
  if os.path.isfile(plan_file):
    with open(plan_file, encoding='utf-8') as f:
      return 'resume' if json.load(f).get('source') == source else 'new'
  if os.path.isdir(out) and os.listdir(out):
    raise ValueError(f'--output {out} is a directory with files and no corpus: name a new '
                     'or empty directory')
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f'--output {out} is a file')
  return 'new'


def check_args(args) -> None:
  if not 0 <= args.eval_fraction <= 1:
    raise ValueError(f'--eval_fraction={args.eval_fraction} is not in [0, 1]')
  if args.eval_tokens < 0:
    raise ValueError(f'--eval_tokens={args.eval_tokens} must be at least 0')
  if args.workers < 1:
    raise ValueError(f'--workers={args.workers} must be at least 1')
  if not (math.isfinite(args.shard_size_mb) and args.shard_size_mb > 0):
    raise ValueError(f'--shard_size_mb={args.shard_size_mb} must be finite and > 0')
  files_lib.check_length(args.output, '--output ', below=len(f'/{WORK}/u-00000-train.bytes.tmp'))


def prepare(args) -> int:
  """Everything after the checks of main(); returns the exit status."""
  check_args(args)
  tok = tokenizer_lib.load(args.tokenizer)
  files = expand(args.input)
  check_inputs(files, args.text_field)
  source = fingerprint(files, args, tok)
  state = output_state(args.output, source)
  work_dir = os.path.join(args.output, WORK)
  if state == 'done':
    shutil.rmtree(work_dir, ignore_errors=True)  # left by a run stopped after its manifest
    print(f'{args.output} is already prepared from these inputs: nothing to do')
    return 0
  if state == 'new':
    shutil.rmtree(work_dir, ignore_errors=True)  # an unfinished run of other input
  units = plan(files)
  existed = os.path.isdir(args.output)
  os.makedirs(work_dir, exist_ok=True)
  _write_json(os.path.join(work_dir, 'plan.json'), {'source': source})
  dtype = 'uint16' if tok.vocab_size <= 2**16 else 'uint32'
  try:
    stats = run_units(units, files, work_dir, args, dtype, fraction_limit(args.eval_fraction))
    stats = _hold_out_tokens(units, files, work_dir, args, dtype, stats)
  except ValueError:  # bad input found while reading: leave nothing behind
    shutil.rmtree(work_dir if existed else args.output, ignore_errors=True)
    raise
  splits = assemble(args.output, work_dir, stats, int(args.shard_size_mb * 2**20), dtype,
                    not tok.byte_level)
  manifest = {'format': data_lib.FORMAT, 'fingerprint': _digest(source), 'source': source,
              'tokenizer': _tokenizer_record(tok, args.tokenizer), 'dtype': dtype,
              'empty_documents_skipped': sum(s['empty'] for s in stats),
              'replaced': sum(s.get('replaced', 0) for s in stats), 'splits': splits}
  _write_json(os.path.join(args.output, data_lib.MANIFEST), manifest)  # last: complete
  shutil.rmtree(work_dir, ignore_errors=True)
  _summary(args.output, splits, manifest['tokenizer'])
  if manifest['replaced']:
    print(f'--errors=replace: replaced {manifest["replaced"]:,} undecodable byte sequence(s) '
          'by U+FFFD and unencodable character(s) by ? (in corpus.json: replaced)')
  return 0


def _hold_out_tokens(units, files, work_dir, args, dtype, stats) -> list[dict]:
  """Tokenizes again, with the limit raised, the units with documents --eval_tokens holds out."""
  limit = hold_out_limit(work_dir, len(units), args.eval_fraction, args.eval_tokens)
  redo = [i for i in range(len(units)) if _below(np.fromfile(
      os.path.join(work_dir, f'u-{i:05d}-train.hash'), np.uint64), limit).any()]
  if not redo:
    return stats
  held = sum(s['eval']['tokens'] for s in stats)
  print(f'prepare: the held-out documents hold {held:,} tokens, fewer than --eval_tokens='
        f'{args.eval_tokens:,}: holding out more, {len(redo)} piece(s) again', file=sys.stderr)
  for i in redo:
    os.remove(os.path.join(work_dir, f'u-{i:05d}.json'))
  return run_units(units, files, work_dir, args, dtype, limit)


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _tokenizer_record(tok, spec: str) -> dict:
  path = '' if tok.byte_level else os.path.abspath(tokenizer_lib.resolve(spec))
  return {'spec': spec, 'name': tok.name, 'path': path, 'byte_level': tok.byte_level,
          'vocab_size': tok.vocab_size, 'eos_id': tok.eos_id,
          'sha256': data_lib.file_sha256(path) if path else ''}


def _summary(out: str, splits: dict, tok: dict) -> None:
  train, held = splits['train'], splits['eval']
  print(f'prepared {out}: {train["documents"]:,} documents, {train["tokens"]:,} tokens in '
        f'{len(train["shards"])} shard(s); held out: {held["documents"]:,} documents, '
        f'{held["tokens"]:,} tokens; tokenizer {tok["name"]}')
  print('train on it: ' + train_command(out, tok))


def train_command(out: str, tok: dict) -> str:
  """The command that trains on corpus ``out``, from this directory, in a workdir of its own.

  ``runs/<corpus name>``: not ``make train``'s runs/default, whose checkpoints (of the
  embedded corpus) a run on this corpus would refuse to resume.
  """
  name = os.path.basename(os.path.abspath(out))
  workdir = os.path.join('runs', name if name != 'default' else 'default_corpus')
  config = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'configs',
                        'default.py')
  args = [hints.shown_path(sys.executable), '-m', 'trainer.train',
          '--config', hints.shown_path(config), '--workdir', workdir, f'--config.data.path={out}']
  if not tok['byte_level']:  # and a model vocabulary that holds it (a multiple of 128)
    args += [f'--config.data.tokenizer={tok["path"]}',
             f'--config.model.vocab_size={-(-tok["vocab_size"] // 128) * 128}']
  return shlex.join(args)



def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    return prepare(args)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except OSError as e:  # a full disk, a file that went away: what was done is kept
    where = f': {e.filename}' if e.filename else ''
    print(f'error: {e.strerror or e}{where}; once that is mended, the same command finishes '
          'the work (pieces done are kept)', file=sys.stderr)
    return 1


if __name__ == '__main__':
  sys.exit(main())
