r"""Training quality of the prepared-corpus reader against random windows of the same tokens.

  python -m benchmarks.data_quality [--workdir /tmp/ringtrain_data_quality] [--mb 4] \
      [--steps 200] [--batch_size 16] [--seq_len 256] [--eval_steps 32] \
      [--reference_runs 20] [--before] [--json] [--keep]

Builds a corpus of long documents from text that ships with the machine's
packages, one file one document, in sorted order, taken in turn from each
source until ``--mb`` MB: the licences of /usr/share/common-licenses, the
changelogs of /usr/share/doc/*/ and the man pages of /usr/share/man/man*/
(gzipped ones unpacked), each at least ``--min_doc_kb`` KiB and cut at
``--max_doc_kb``. Prepares it with ``trainer.prepare`` (byte-level, the default
hold-out) and writes its training split again as one raw ``.bin``. Then trains
the same small model (configs/default.py made small, one CPU device) for
``--steps`` steps of ``--batch_size`` x ``--seq_len`` tokens through both
readers of trainer/pipeline.py, each scored on the prepared corpus's held-out
documents (``--eval_steps`` batches):

  * prepared: ``data.path`` the corpus directory (documents shuffled, packed,
    the packed sequences shuffled: each row drawn from across the epoch);
  * windows: ``data.path`` the ``.bin``, ``data.eval_path`` the corpus: rows are
    windows at random places of the same tokens (as nanoGPT reads a ``.bin``).

and prints their held-out loss side by side (target: prepared within 3% of
windows), with, for each reader, the largest share of a batch's tokens that
come from any one document, its max and mean over the run's batches, next to
what independent draws give: the windows reader over ``--reference_runs`` other
seeds (the median of their maxima, and their range; target: the prepared
reader's not above). ``--before`` adds the reader this one replaced, which
cut batches from consecutive packed sequences, emulated (its shares are always
shown; with ``--before`` it is trained too). The shares come from the readers'
own code reading a stream whose tokens are document numbers.

Bad arguments exit 2 with one line ``error: ...``, before anything is written (too
few such documents on the machine, or held-out tokens for ``--eval_steps``: once the
corpus is built). What the run wrote in ``--workdir`` is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import gzip
import json
import math
import os
import statistics
import sys
import time

from benchmarks import prelude
from benchmarks.input import TooSmall, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, 'configs', 'default.py')
SOURCES = ('/usr/share/common-licenses/*', '/usr/share/doc/*/changelog*',
           '/usr/share/man/man*/*')
MODEL = ['--config.model.d_model=64', '--config.model.num_layers=2',
         '--config.model.num_heads=4', '--config.model.num_kv_heads=4',
         '--config.model.head_dim=16', '--config.model.mlp_dim=256',
         '--config.hardware.cpu_devices=1', '--config.mesh.data=1', '--config.mesh.tensor=1',
         '--config.parallelism.collective_matmul=never', '--config.optimizer.warmup_steps=20',
         '--config.optimizer.learning_rate=3e-3',  # as measured (docs/guide.md)
         '--config.log_every=50', '--config.eval_every=0', '--config.checkpoint.every=0',
         '--config.data.eval_fraction=1e-9']  # .bin: its tail is not held out (eval_path is)


def _text(path: str) -> bytes:
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rb') as f:
    return f.read()


def collect(mb: float, min_kb: float, max_kb: float) -> tuple[list[bytes], dict]:
  """Documents from SOURCES in turn until ``mb`` MB; (documents, how many per source)."""
  queues = [iter(sorted(p for p in glob.glob(s) if os.path.isfile(p))) for s in SOURCES]
  docs, counts, total = [], dict.fromkeys(SOURCES, 0), 0
  while queues and total < mb * 1e6:
    for source, queue in list(zip(SOURCES, queues)):
      text = next((t for t in map(_text_or_none, queue) if t and len(t) >= min_kb * 1024),
                  None)
      if text is None:
        queues.remove(queue)
        continue
      docs.append(text[:int(max_kb * 1024)])
      counts[source] += 1
      total += len(docs[-1])
      if total >= mb * 1e6:
        break
  return docs, counts


def _text_or_none(path: str) -> bytes | None:
  try:
    return _text(path)
  except (OSError, EOFError):  # unreadable or a broken .gz: not a document
    return None


def build_corpus(args) -> dict:
  """The corpus prepared in WORKDIR/corpus, its training split as WORKDIR/train.bin."""
  from trainer import data, prepare  # pylint: disable=g-import-not-at-top
  docs, counts = collect(args.mb, args.min_doc_kb, args.max_doc_kb)
  if sum(len(d) for d in docs) < args.mb * 1e6 / 2:
    raise TooSmall(f'--mb {args.mb:g}: this machine has {sum(map(len, docs)) / 1e6:.1f} MB of '
                   f'such documents (at least --min_doc_kb={args.min_doc_kb:g} KiB)')
  text = os.path.join(args.workdir, 'corpus.jsonl')
  with open(text, 'w', encoding='utf-8') as f:
    for doc in docs:
      f.write(json.dumps({'text': doc.decode('utf-8', errors='replace')}) + '\n')
  corpus = os.path.join(args.workdir, 'corpus')
  with contextlib.redirect_stdout(sys.stderr):  # stdout: the results alone
    assert prepare.main(['--input', text, '--output', corpus, '--workers', '1']) == 0
  manifest, train = data.open_prepared(corpus, 'train')
  train.tokens().astype(manifest['dtype']).tofile(os.path.join(args.workdir, 'train.bin'))
  lengths = [len(d) for d in docs]
  return {'documents': len(docs), 'text_mb': sum(lengths) / 1e6,
          'median_document_kb': statistics.median(lengths) / 1024,
          'per_source': {s.split('/*')[0]: n for s, n in counts.items()},
          'train_tokens': manifest['splits']['train']['tokens'],
          'held_out_tokens': manifest['splits']['eval']['tokens'],
          'held_out_documents': manifest['splits']['eval']['documents']}


@contextlib.contextmanager
def consecutive_sequences():
  """The reader before: row r of step k the packed sequence k * batch_size + r (in order)."""
  from trainer import pipeline  # pylint: disable=g-import-not-at-top
  epoch = pipeline.Packer._epoch  # pylint: disable=protected-access
  pipeline.Packer._epoch = lambda self, e: epoch(self, e)[:2] + (None,)  # sequences in order
  try:
    yield
  finally:
    pipeline.Packer._epoch = epoch


def train(args, name: str, path: str, eval_path: str = '') -> dict:
  """Trains the small model on ``path``; its last eval record and the seconds it took."""
  from trainer import train as train_lib  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(args.workdir, f'run-{name}')
  start = time.time()
  with contextlib.redirect_stdout(sys.stderr):
    code = train_lib.main(['--config', DEFAULT, '--workdir', workdir, *MODEL,
                           f'--config.steps={args.steps}', f'--config.seed={args.seed}',
                           f'--config.batch_size={args.batch_size}',
                           f'--config.seq_len={args.seq_len}',
                           f'--config.eval_steps={args.eval_steps}',
                           f'--config.data.path={path}', f'--config.data.eval_path={eval_path}'])
  if code:
    raise RuntimeError(f'training on {path} exited {code} (its output is above)')
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    last = [r for r in map(json.loads, f) if 'eval_loss' in r][-1]
  return {'eval_loss': last['eval_loss'], 'eval_bpb': last.get('eval_bpb'),
          'seconds': time.time() - start}


def shares(corpus, bounds, seed: int, batch_size: int, seq_len: int, steps: int) -> list[float]:
  """Per batch, the largest share of its tokens from one document, as ``corpus``'s reader
  (trainer/pipeline.py) builds its batches, reading a stream of the same layout whose
  tokens are the numbers of their documents (``bounds``: where each begins)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from trainer import data, pipeline  # pylint: disable=g-import-not-at-top
  stream = corpus.train[0]
  ids = np.repeat(np.arange(len(bounds) - 1, dtype=np.int32), np.diff(bounds))
  numbered = data.Stream([ids[:stream.num_tokens]], stream.bounds)
  dataset = pipeline.train_dataset(dataclasses.replace(corpus, train=(numbered,)), seed,
                                   batch_size, seq_len, np.arange(batch_size))
  return [float(np.bincount(dataset[k]['inputs'].ravel()).max()) / (batch_size * seq_len)
          for k in range(steps)]


def measure(args) -> dict:
  os.makedirs(args.workdir, exist_ok=True)
  from trainer import config as config_lib, data  # pylint: disable=g-import-not-at-top
  out = {'corpus': build_corpus(args), 'readers': {}}
  corpus_dir, binary = (os.path.join(args.workdir, n) for n in ('corpus', 'train.bin'))
  held = out['corpus']['held_out_tokens']
  fits = (held - 1) // (args.batch_size * args.seq_len)
  if fits < args.eval_steps:
    raise TooSmall(f'--eval_steps={args.eval_steps}: the held-out split has {held:,} tokens, '
                   f'{fits} batch(es) of {args.batch_size} x {args.seq_len}')
  cfg = config_lib.Data(path=corpus_dir)
  prepared = data.load(cfg, 264, args.seed)
  windows = data.load(config_lib.Data(path=binary, eval_path=corpus_dir, eval_fraction=1e-9),
                      264, args.seed)
  bounds = prepared.train[0].bounds  # the .bin holds the same documents, back to back
  readers = {'prepared': (prepared, corpus_dir, '', contextlib.nullcontext),
             'windows': (windows, binary, corpus_dir, contextlib.nullcontext),
             'before': (prepared, corpus_dir, '', consecutive_sequences)}
  for name, (loaded, path, eval_path, order) in readers.items():
    with order():
      share = shares(loaded, bounds, args.seed, args.batch_size, args.seq_len, args.steps)
      row = {'share_max': max(share), 'share_mean': statistics.mean(share)}
      if name != 'before' or args.before:
        print(f'training through the {name} reader', file=sys.stderr)
        row.update(train(args, name, path, eval_path))
    out['readers'][name] = row
  reference = [shares(windows, bounds, args.seed + 1 + i, args.batch_size, args.seq_len,
                      args.steps) for i in range(args.reference_runs)]
  out['independent'] = {'share_max': statistics.median(max(r) for r in reference),
                        'share_max_range': [min(map(max, reference)), max(map(max, reference))],
                        'share_mean': statistics.mean(statistics.mean(r) for r in reference),
                        'share_mean_range': [min(map(statistics.mean, reference)),
                                             max(map(statistics.mean, reference))],
                        'runs': args.reference_runs}
  out['settings'] = {k: getattr(args, k) for k in ('steps', 'batch_size', 'seq_len',
                                                   'eval_steps', 'seed')}
  return out


def report(out: dict) -> str:
  c, s = out['corpus'], out['settings']
  sources = ', '.join(f'{n} from {p}' for p, n in c['per_source'].items())
  lines = [f"corpus: {c['documents']} documents, {c['text_mb']:.1f} MB of text (median "
           f"document {c['median_document_kb']:.0f} KiB; {sources}); "
           f"{c['train_tokens']:,} training tokens, held out {c['held_out_documents']} "
           f"documents, {c['held_out_tokens']:,} tokens",
           f"{s['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens each reader; "
           f"held-out loss over {s['eval_steps']} batches",
           f"{'reader':30} {'held-out loss':>13} {'bits/byte':>9} {'train s':>7}   "
           "one document's share of a batch: max   mean"]
  names = {'prepared': 'prepared (shuffled sequences)', 'windows': 'random windows (.bin)',
           'before': 'before: consecutive sequences'}
  for name, row in out['readers'].items():
    loss = (f"{row['eval_loss']:13.4f} {row['eval_bpb']:9.3f} {row['seconds']:7.0f}"
            if 'eval_loss' in row else f"{'-':>13} {'-':>9} {'-':>7}")
    lines.append(f"{names[name]:30} {loss}   {row['share_max']:36.3f} {row['share_mean']:6.3f}")
  ref = out['independent']
  lines.append(f"{'independent draws':30} {'':31}   {ref['share_max']:36.3f} "
               f"{ref['share_mean']:6.3f}")
  lines.append(f"  (independent draws: the windows reader with {ref['runs']} other seeds; max: "
               f"the median of their maxima, which range {ref['share_max_range'][0]:.3f}-"
               f"{ref['share_max_range'][1]:.3f}; mean: of their means, which range "
               f"{ref['share_mean_range'][0]:.3f}-{ref['share_mean_range'][1]:.3f})")
  p, w = out['readers']['prepared'], out['readers']['windows']
  lines.append(f"prepared / windows held-out loss: {p['eval_loss'] / w['eval_loss']:.3f} "
               f"(target <= 1.03); prepared's share of a batch from one document: max "
               f"{p['share_max']:.3f}, mean {p['share_mean']:.3f}, independent draws "
               f"{ref['share_max']:.3f}, {ref['share_mean']:.3f} (target: not above)")
  return '\n'.join(lines)


def check(args) -> str | None:
  """What is wrong with the arguments, in one line; None when nothing is."""
  for name in ('mb', 'min_doc_kb', 'max_doc_kb'):
    value = getattr(args, name)
    if not (math.isfinite(value) and value > 0):
      return f'--{name} {value:g} must be finite and > 0'
  if args.max_doc_kb < args.min_doc_kb:
    return f'--max_doc_kb {args.max_doc_kb:g} is below --min_doc_kb {args.min_doc_kb:g}'
  error = prelude.at_least_one(args, 'steps', 'batch_size', 'seq_len', 'eval_steps',
                               'reference_runs')
  if error:
    return error
  if args.seq_len > 1024:
    return f'--seq_len={args.seq_len} is more than the model accepts (1024)'
  if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
    return f'--workdir {args.workdir} is a file, not a directory'
  return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', default='/tmp/ringtrain_data_quality')
  parser.add_argument('--mb', type=float, default=4.0, help='corpus text, MB (default 4)')
  parser.add_argument('--min_doc_kb', type=float, default=16, help='shortest document (KiB)')
  parser.add_argument('--max_doc_kb', type=float, default=256,
                      help='documents are cut at this many KiB')
  parser.add_argument('--steps', type=int, default=200, help='training steps of each reader')
  parser.add_argument('--batch_size', type=int, default=16)
  parser.add_argument('--seq_len', type=int, default=256)
  parser.add_argument('--eval_steps', type=int, default=32, help='held-out batches scored')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--reference_runs', type=int, default=20,
                      help='seeds of the independent-draws reference')
  parser.add_argument('--before', action='store_true',
                      help='also train through the consecutive-sequence reader')
  parser.add_argument('--json', action='store_true')
  parser.add_argument('--keep', action='store_true', help='keep the corpus and runs in --workdir')
  args = parser.parse_args(argv)
  return run(args, check, measure, report)

if __name__ == '__main__':
  sys.exit(main())
