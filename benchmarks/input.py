r"""The input pipeline alone: tokens/s on a large prepared corpus, and its memory.

  python -m benchmarks.input [--workdir /tmp/ringtrain_input] [--gib 2] \
      [--shapes 16x256 64x2048] [--repeats 3] [--json] [--keep]

Writes JSONL text (Python standard library source cut into documents of 64 B
to 16 KiB) and prepares it with ``trainer.prepare`` (byte-level) twice: a
corpus of ``--gib`` GiB of tokens and one of 2 MB. Then, each in a fresh
process, reads one epoch of the large corpus (the number of tokens of its
training split) in batches of each of ``--shapes`` (the default config's 16 x
256, and 64 x 2048, a host's share of a larger run):

  * pipeline: the training batches trainer/pipeline.py builds (documents
    shuffled, packed, segments and positions), one process holding every row,
    built in the reading thread as the memmap reader's are; and again through
    its prefetching thread (``pipeline.Prefetcher``, ``data.prefetch`` ahead),
    which in training hides the building behind the device step and here, with
    nothing to hide behind, adds the handover between threads;
  * memmap: a bare reader of the same shard files, ``np.memmap`` windows at
    random places stacked and cast to int32 (no documents, shuffling or prefetch);
  * pipeline on the 2 MB corpus, as many batches of the first shape: the peak RSS
    (resident memory, memory-mapped pages included) next to the large one's.

and how long opening the large corpus takes (``data.load`` reads every shard
once: no token id may reach ``model.vocab_size``); and compiles and times the
default config's train step (benchmarks/train_step.py) for the rate training
consumes tokens at. Targets: pipeline >= 10x the
default config's rate and >= 0.8x the memmap reader; peak RSS over the large
corpus within 300 MB of the small one's. Each reader reads its epoch
``--repeats`` times, alternated with the other, and the median is reported
(this shared machine's rates vary by a third between runs). The corpora stay in ``--workdir``
for the next run with ``--keep``; else what this run wrote there is deleted at the end, and
the directory itself when this run made it (what was there before, such as corpora an
earlier run kept, stays).

Bad arguments exit 2 with one line ``error: ...``, before anything is written (a shape
larger than the large corpus's training split: once that corpus is prepared).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import multiprocessing
import os
import random
import re
import resource
import shutil
import sys
import time

from benchmarks import prelude

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_BYTES = 1 << 20  # text of the small corpus: 2 MB of uint16 tokens
PART_BYTES = 128 << 20  # text per JSONL file
DEFAULT = os.path.join(ROOT, 'configs', 'default.py')


class TooSmall(Exception):
  """The arguments ask for more than the corpus gives (here: less than one batch of a
  shape): bad input, exit status 2."""


def write_text(directory: str, total: int) -> None:
  """JSONL files of ``total`` bytes of text: standard library source cut into documents."""
  os.makedirs(directory, exist_ok=True)
  rng = random.Random(0)
  sources = [open(f, encoding='utf-8', errors='replace').read()
             for f in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), '*.py')))]
  written, part, n = 0, 0, 0
  while written < total:
    with open(os.path.join(directory, f'part-{part:03d}.jsonl'), 'w', encoding='utf-8') as f:
      size = 0
      while size < min(PART_BYTES, total - written):
        text = rng.choice(sources)
        length = int(2 ** rng.uniform(6, 14))
        start = rng.randrange(max(1, len(text) - length))
        doc = f'# document {n}\n' + text[start:start + length]
        line = json.dumps({'text': doc}) + '\n'
        f.write(line)
        size, n = size + len(doc.encode('utf-8')), n + 1
    written, part = written + size, part + 1


def prepared(workdir: str, name: str, text_bytes: int) -> str:
  """The corpus ``name`` prepared from ``text_bytes`` of text (made once)."""
  from trainer import prepare  # pylint: disable=g-import-not-at-top
  text, out = os.path.join(workdir, f'text-{name}'), os.path.join(workdir, name)
  if not glob.glob(os.path.join(text, '*.jsonl')):
    print(f'writing {text_bytes / 2**20:,.0f} MiB of text to {text}', file=sys.stderr)
    write_text(text, text_bytes)
  start = time.time()
  with contextlib.redirect_stdout(sys.stderr):  # stdout: the results alone
    assert prepare.main(['--input', os.path.join(text, '*.jsonl'), '--output', out]) == 0
  print(f'prepare {name}: {time.time() - start:.1f} s', file=sys.stderr)
  return out


def run_pipeline(path: str, batch_size: int, seq_len: int, batches: int,
                 prefetch: int | None = None) -> dict:
  """Reads ``batches`` training batches as the default config's pipeline would (fresh
  process), ``prefetch`` ahead (default ``data.prefetch``; 0: built in the caller)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from trainer import config as config_lib, data, pipeline  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(DEFAULT, [f'--config.data.path={path}'])
  start = time.perf_counter()
  corpus = data.load(cfg.data, cfg.model.vocab_size, cfg.seed)  # scans the shards' ids
  load_s = time.perf_counter() - start
  dataset = pipeline.train_dataset(corpus, cfg.seed, batch_size, seq_len, np.arange(batch_size))
  batches_ahead = pipeline.Prefetcher(
      dataset, cfg.data.prefetch if prefetch is None else prefetch)
  start = time.perf_counter()
  for step in range(batches):
    batches_ahead.get(step)
  batches_ahead.close()
  return _result(batches * batch_size * seq_len, time.perf_counter() - start) | {
      'load_seconds': load_s}


def run_memmap(path: str, batch_size: int, seq_len: int, batches: int) -> dict:
  """Reads as many tokens as bare ``np.memmap`` windows of the same shards."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from trainer import data  # pylint: disable=g-import-not-at-top
  manifest = data.read_manifest(path)
  maps = [np.memmap(os.path.join(path, s['name'] + '.bin'), manifest['dtype'], 'r')
          for s in manifest['splits']['train']['shards']]
  rng = np.random.default_rng(0)
  weights = np.array([len(m) for m in maps], float)
  start = time.perf_counter()
  for _ in range(batches):
    shards = rng.choice(len(maps), size=batch_size, p=weights / weights.sum())
    offsets = (rng.random(batch_size) * (weights[shards] - seq_len - 1)).astype(np.int64)
    np.stack([maps[s][o:o + seq_len + 1] for s, o in zip(shards, offsets)]).astype(np.int32)
  return _result(batches * batch_size * seq_len, time.perf_counter() - start)


def _result(tokens: int, seconds: float) -> dict:
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
  return {'tokens': tokens, 'seconds': seconds, 'tokens_per_sec': tokens / seconds,
          'peak_rss_mb': rss / 1e6}


def default_config_rate(workdir: str) -> float:
  """Tokens/s the default config's train step consumes (8 simulated CPU devices)."""
  prelude.start_cpu(8)
  from benchmarks import train_step  # pylint: disable=g-import-not-at-top
  from trainer import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(DEFAULT)
  seconds = train_step.step_seconds(DEFAULT, 'always', 5, workdir)['median_step_seconds']
  return cfg.batch_size * cfg.seq_len / seconds


def _fresh(fn, *args):
  """``fn(*args)`` in a new process (its own peak RSS)."""
  with multiprocessing.get_context('spawn').Pool(1) as pool:
    return pool.apply(fn, args)


def measure(args) -> dict:
  os.makedirs(args.workdir, exist_ok=True)
  big = prepared(args.workdir, f'big-{args.gib:g}gib', int(args.gib * 2**30 / 2))
  small = prepared(args.workdir, 'small', SMALL_BYTES)
  from trainer import data  # pylint: disable=g-import-not-at-top
  tokens = data.read_manifest(big)['splits']['train']['tokens']
  out = {'corpus_bytes': {'big': _bytes(big), 'small': _bytes(small)}, 'shapes': {}}
  for shape in args.shapes:
    batch_size, seq_len = map(int, shape.split('x'))
    batches = tokens // (batch_size * seq_len)  # one epoch of the large corpus
    if batches < 1:
      raise TooSmall(f'--gib {args.gib:g} gives {tokens:,} training tokens, less than one '
                       f'batch of --shapes {shape}')
    print(f'{shape}: reading {batches:,} batches, {args.repeats} times each', file=sys.stderr)
    readers = {'pipeline': (run_pipeline, 0), 'pipeline_prefetch': (run_pipeline, None),
               'memmap': (run_memmap,)}
    trials = {name: [] for name in readers}
    for _ in range(args.repeats):  # alternated: all see the same machine load
      for name, (run, *extra) in readers.items():
        trials[name].append(_fresh(run, big, batch_size, seq_len, batches, *extra))
    runs = {name: _median(t) for name, t in trials.items()}
    if shape == args.shapes[0]:
      runs['pipeline_small'] = _fresh(run_pipeline, small, batch_size, seq_len, batches)
    out['shapes'][shape] = runs
  out['default_config_tokens_per_sec'] = _fresh(  # reads no checkpoints, writes nothing
      default_config_rate, os.path.join(args.workdir, 'train_step'))
  return out


def _median(trials: list[dict]) -> dict:
  """The trial with the median rate (all its numbers), and every trial's rate."""
  ranked = sorted(trials, key=lambda t: t['tokens_per_sec'])
  return ranked[len(ranked) // 2] | {'trial_tokens_per_sec': [t['tokens_per_sec'] for t in trials]}


def _bytes(path: str) -> int:
  return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, '*.bin')))


def report(out: dict) -> str:
  big, small = (out['corpus_bytes'][k] / 1e6 for k in ('big', 'small'))
  default = out['default_config_tokens_per_sec']
  lines = [f'default config consumes {default:,.0f} tokens/s; corpus {big:,.0f} MB of tokens',
           'batch      pipeline M tok/s  x default (>= 10)  memmap M tok/s  x memmap (>= 0.8)'
           '  with prefetch thread M tok/s  x memmap']
  for shape, runs in out['shapes'].items():
    p, m = runs['pipeline']['tokens_per_sec'], runs['memmap']['tokens_per_sec']
    t = runs['pipeline_prefetch']['tokens_per_sec']
    lines.append(f'{shape:10} {p / 1e6:16.1f} {p / default:18,.0f} {m / 1e6:15.1f} '
                 f'{p / m:16.2f} {t / 1e6:29.1f} {t / m:9.2f}')
  lines.append('(pipeline and memmap build each batch in the reading thread; the prefetch '
               'column hands them over from data.prefetch batches built ahead in a thread, '
               'which in training hides the building behind the device step)')
  first = next(iter(out['shapes'].values()))
  rss, rss_small = first['pipeline']['peak_rss_mb'], first['pipeline_small']['peak_rss_mb']
  lines.append(f'peak RSS reading {first["pipeline"]["tokens"]:,} tokens: {rss:,.0f} MB from '
               f'the {big:,.0f} MB corpus, {rss_small:,.0f} MB from the {small:,.1f} MB one: '
               f'{rss - rss_small:+,.0f} MB (target: within 300 MB); the memmap reader: '
               f'{first["memmap"]["peak_rss_mb"]:,.0f} MB')
  load = first['pipeline']['load_seconds']
  lines.append(f'opening the {big:,.0f} MB corpus (data.load: every shard read once, its '
               f'largest token id checked against model.vocab_size): {load:.2f} s, '
               f'{big / 1e3 / load:.1f} GB/s')
  return '\n'.join(lines)


def check(args) -> str | None:
  """What is wrong with the arguments, in one line; None when nothing is."""
  least = 2 * SMALL_BYTES / 2**30  # GiB of tokens: the small corpus's
  if not (math.isfinite(args.gib) and args.gib >= least):
    return f'--gib {args.gib:g} must be finite and at least {least:g} (the small corpus)'
  for shape in args.shapes:
    m = re.fullmatch(r'(\d+)x(\d+)', shape)
    if not m or min(map(int, m.groups())) < 1:
      return f'--shapes {shape!r} is not BATCHxSEQ_LEN with both at least 1 (e.g. 16x256)'
  if args.repeats < 1:
    return f'--repeats={args.repeats} must be at least 1'
  if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
    return f'--workdir {args.workdir} is a file, not a directory'
  return None


def remove_made(workdir: str, before: set[str] | None) -> None:
  """Deletes what this run made in ``workdir``: the names not in ``before`` (what was there
  when it started), or the whole directory when ``before`` is None (the run made it)."""
  if before is None:
    shutil.rmtree(workdir, ignore_errors=True)
    return
  for name in sorted(set(os.listdir(workdir)) - before):
    path = os.path.join(workdir, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      os.remove(path)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', default='/tmp/ringtrain_input')
  parser.add_argument('--gib', type=float, default=2.0, help='large corpus, GiB of tokens')
  parser.add_argument('--shapes', nargs='+', default=['16x256', '64x2048'],
                      help='batch_size x seq_len (default: the default config, then larger)')
  parser.add_argument('--repeats', type=int, default=3,
                      help='epochs read by each reader per shape, alternated; the median is shown')
  parser.add_argument('--json', action='store_true')
  parser.add_argument('--keep', action='store_true', help='keep the corpora in --workdir')
  args = parser.parse_args(argv)
  return run(args, check, measure, report)


def run(args, check, measure, report) -> int:
  """What the corpus benchmarks share after parsing ``args``: ``check`` them (one line,
  exit 2), ``measure`` in ``args.workdir`` (removing what it made there unless
  ``args.keep``), print ``report`` of it or its JSON (``args.json``)."""
  error = check(args)
  if error:
    return prelude.refuse(error)
  sys.path.insert(0, ROOT)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  before = set(os.listdir(args.workdir)) if os.path.isdir(args.workdir) else None
  try:
    out = measure(args)
  except TooSmall as e:
    return prelude.refuse(str(e))
  finally:
    if not args.keep:
      remove_made(args.workdir, before)
  print(json.dumps(out, indent=1) if args.json else report(out))
  return 0

if __name__ == '__main__':
  sys.exit(main())
