r"""Tokenizes a text corpus once into token shards that training reads lazily.

  python -m trainer.prepare --input 'corpus/*.jsonl' [more files or globs ...] \
      --output data/mycorpus [--tokenizer SPEC] [--text_field text] \
      [--eval_fraction 0.01] [--eval_tokens 131073] [--workers N] [--shard_size_mb 512]

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
until they do (at most half the corpus's tokens; one document always trains):
the pieces of work with such documents are tokenized again.

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
import shutil
import sys
import time

import numpy as np

from trainer import data as data_lib
from trainer import tokenizer as tokenizer_lib

UNIT_BYTES = 32 << 20  # input bytes per piece of work (a worker's task)
DOCS_PER_CALL = 1024   # documents tokenized per call
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
    raise ValueError("Parquet input needs pyarrow: pip install -e '.[data]'") from None
  return pq


def _json(line: bytes, path: str, offset: int):
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
  return {'format': data_lib.FORMAT, 'inputs': inputs, 'tokenizer': tokenizer,
          'text_field': args.text_field, 'eval_fraction': args.eval_fraction,
          'eval_tokens': args.eval_tokens,
          'unit_bytes': UNIT_BYTES, 'shard_size_mb': args.shard_size_mb}


# ----------------------------------------------------------------- workers

_TOKENIZER = {}


def _documents(unit: dict, field: str):
  """The unit's documents, as bytes (text files) or str."""
  if unit['kind'] == 'text':
    for path in unit['files']:
      with open(path, 'rb') as f:
        yield f.read()
  elif unit['kind'] == 'jsonl':
    with open(unit['file'], 'rb') as f:
      f.seek(max(unit['start'] - 1, 0))
      if unit['start']:
        f.readline()  # the line that began before the unit belongs to the previous one
      while f.tell() < unit['stop']:
        offset, line = f.tell(), f.readline()
        if line.strip():
          yield _text_of(_json(line, unit['file'], offset), field, unit['file'], offset)
  else:
    table = _parquet().ParquetFile(unit['file']).read_row_groups(unit['groups'], columns=[field])
    for text in table.column(0).to_pylist():
      if text is not None and not isinstance(text, str):
        raise ValueError(f'--text_field={field!r}: {unit["file"]} holds a '
                         f'{type(text).__name__}, not text')
      yield text or ''


def held_out(text: bytes, fraction: float) -> bool:
  """Whether a document (its UTF-8 bytes) is held out: a hash of it below ``fraction``
  (before ``--eval_tokens`` raises the limit: hold_out_limit)."""
  return doc_hash(text) < fraction_limit(fraction)


def doc_hash(text: bytes) -> int:
  """A document's place in the hold-out order: a hash of its UTF-8 bytes in [0, 2**64)."""
  return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), 'little')


def fraction_limit(fraction: float) -> int:
  """The hash limit that holds out ``fraction`` of the documents (hashes below it)."""
  return math.ceil(fraction * 2**64)


def hold_out_limit(work_dir: str, count: int, fraction: float, tokens: int) -> int:
  """The hash limit of the held-out documents: ``fraction``'s, raised (documents by hash)
  until they hold ``tokens`` tokens or half the corpus's; one document stays in training."""
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
  first = min(int(np.searchsorted(total, min(tokens, total[-1] // 2))), len(hashes) - 2)
  return base if first < 0 else max(base, int(hashes[first]) + 1)


def _below(hashes: np.ndarray, limit: int) -> np.ndarray:
  return hashes < limit if limit < 2**64 else np.ones(hashes.shape, bool)


def work(index: int, unit: dict, out: str, spec: str, field: str, limit: float,
         dtype: str) -> dict:
  """Tokenizes one unit into ``out/u-INDEX-{train,eval}.*``; returns its counts.

  Documents whose hash (doc_hash) is below ``limit`` are held out.
  """
  if spec not in _TOKENIZER:
    os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')  # one process per core already
    _TOKENIZER[spec] = tokenizer_lib.load(spec)
  tok = _TOKENIZER[spec]
  writers = {s: _UnitWriter(os.path.join(out, f'u-{index:05d}-{s}'), dtype, s == 'eval'
                            and not tok.byte_level) for s in data_lib.SPLITS}
  batches = {s: [] for s in data_lib.SPLITS}
  hashes = {s: [] for s in data_lib.SPLITS}
  stats = {'documents': 0, 'empty': 0, 'bytes': unit['bytes']}

  def flush(split):
    ids, counts, lengths = data_lib.encode_documents(batches[split], tok)
    doc_hashes = np.array(hashes[split], np.uint64)
    batches[split], hashes[split] = [], []
    if ids.size and int(ids.max()) > np.iinfo(dtype).max:  # astype would wrap it
      raise ValueError(f'tokenizer {tok.name} gave token id {int(ids.max())}, more than the '
                       f'corpus dtype {dtype} holds (its vocab_size is {tok.vocab_size})')
    # Without an end-of-document token, a document can tokenize to nothing (blank text):
    # it has no place in the index (bounds_of), so it is skipped like an empty one.
    nothing = int((lengths == 0).sum())
    stats['documents'] -= nothing
    stats['empty'] += nothing
    writers[split].write(ids, counts, lengths[lengths > 0], doc_hashes[lengths > 0])

  for doc in _documents(unit, field):
    # UTF-8 without what cannot be encoded (a lone surrogate a JSON escape can hold):
    # what is hashed is what is tokenized.
    raw = doc if isinstance(doc, bytes) else doc.encode('utf-8', errors='replace')
    if not raw:
      stats['empty'] += 1
      continue
    digest = doc_hash(raw)
    split = 'eval' if digest < limit else 'train'
    batches[split].append(raw)
    hashes[split].append(digest)
    stats['documents'] += 1
    if len(batches[split]) == DOCS_PER_CALL:
      flush(split)
  for split, writer in writers.items():
    if batches[split]:
      flush(split)
    stats[split] = writer.close()
  _write_json(os.path.join(out, f'u-{index:05d}.json'), stats)  # last: the unit is done
  return stats


class _UnitWriter:
  """Appends one split's tokens, document lengths and (held out) byte counts."""

  def __init__(self, stem: str, dtype: str, counts: bool):
    self.stem, self.dtype, self.tokens, self.text_bytes = stem, dtype, 0, 0
    self.files = {'bin': open(stem + '.bin', 'wb'), 'len': open(stem + '.len', 'wb'),
                  'hash': open(stem + '.hash', 'wb')}
    if counts:
      self.files['bytes'] = open(stem + '.bytes', 'wb')

  def write(self, ids: np.ndarray, counts: np.ndarray, lengths: np.ndarray,
            hashes: np.ndarray) -> None:
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
                             limit, dtype): i for i in todo}
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
              'empty_documents_skipped': sum(s['empty'] for s in stats), 'splits': splits}
  _write_json(os.path.join(args.output, data_lib.MANIFEST), manifest)  # last: complete
  shutil.rmtree(work_dir, ignore_errors=True)
  _summary(args.output, splits, manifest['tokenizer'])
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
  print(f'train on it: python -m trainer.train --config configs/default.py '
        f'--config.data.path={out}' + ('' if tok['byte_level'] else
                                       f' --config.data.tokenizer={tok["path"]}'))


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    return prepare(args)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
