r"""Peak memory of trainer.prepare on one huge document: bounded, whatever its size.

  python -m benchmarks.prepare_memory [--mb 200] [--kind text|jsonl] [--tokenizer SPEC] \
      [--workdir /tmp/ringtrain_prepare_memory] [--json]

Writes one document of ``--mb`` MB (10^6 bytes) as a single line without a
newline (Python standard library source, its newlines turned into spaces):
a text file (``--kind text``) or one JSONL record. Then prepares it with
``python -m trainer.prepare --workers 1`` in a child process, after preparing
a 1 kB document the same way, and prints each one's peak resident memory
(``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the largest of the prepare process
and its tokenizing worker) and time. A text file is read and tokenized in
pieces of ``trainer.prepare.PIECE_BYTES``, so its peak stays near the 1 kB
document's (other tokenizers: in pieces of ``PIECE_CHARS`` characters); a JSONL
record is held whole as text (its JSON line, the string,
its UTF-8 bytes), so its peak grows with it. Target (text): peak RSS < 600 MB
for 200 MB. What this run wrote in ``--workdir`` is deleted at the end.

Bad arguments exit 2 with one line ``error: ...``, before anything is written.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_MB = 600  # for the text file of 200 MB


def parse_args(argv):
  p = argparse.ArgumentParser(prog='python -m benchmarks.prepare_memory', description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--mb', type=float, default=200, help='document size, MB (default 200)')
  p.add_argument('--kind', choices=('text', 'jsonl'), default='text',
                 help='a text file (default) or one JSONL record')
  p.add_argument('--tokenizer', default='', help="prepare's --tokenizer ('' bytes)")
  p.add_argument('--workdir', default='/tmp/ringtrain_prepare_memory',
                 help='where the document and corpora are written (deleted at the end)')
  p.add_argument('--json', action='store_true', help='print one JSON object')
  return p.parse_args(argv)


def write_document(path: str, size: int, kind: str) -> None:
  """One line of ``size`` bytes (about, for JSONL: its text) of source text, no newline."""
  sources = [open(f, 'rb').read()
             for f in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), '*.py')))]
  printable = bytes(c if 32 <= c < 127 else 32 for c in range(256))  # one line, ASCII
  block = b' '.join(sources).translate(printable)
  with open(path, 'wb') as f:
    if kind == 'jsonl':  # escapes of two characters only: \" and \\
      f.write(b'{"text": "')
      block = json.dumps(block.decode('ascii'))[1:-1].encode('ascii')
    written = 0
    while written < size:
      part = block[:size - written]
      if kind == 'jsonl':  # not the half of an escape (\")
        part = part[:len(part) - (len(part) - len(part.rstrip(b'\\'))) % 2]
      f.write(part)
      written += len(part)
    if kind == 'jsonl':
      f.write(b'"}\n')


def peak_of_prepare(document: str, output: str, tokenizer: str) -> tuple[float, float]:
  """(peak RSS of the children so far in MB, seconds) after preparing ``document``."""
  start = time.perf_counter()
  subprocess.run([sys.executable, '-m', 'trainer.prepare', '--input', document, '--output',
                  output, '--workers', '1', '--eval_fraction', '0', '--tokenizer', tokenizer],
                 cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  seconds = time.perf_counter() - start
  return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, seconds  # KiB


def measure(args) -> dict:
  suffix = '.jsonl' if args.kind == 'jsonl' else '.txt'
  small, large = (os.path.join(args.workdir, f'{n}{suffix}') for n in ('small', 'large'))
  write_document(small, 1000, args.kind)
  write_document(large, int(args.mb * 1e6), args.kind)
  small_rss, small_s = peak_of_prepare(small, os.path.join(args.workdir, 'small'),
                                       args.tokenizer)
  large_rss, large_s = peak_of_prepare(large, os.path.join(args.workdir, 'large'),
                                       args.tokenizer)
  return {'kind': args.kind, 'tokenizer': args.tokenizer or 'bytes',
          'document_mb': os.path.getsize(large) / 1e6, 'small_peak_rss_mb': small_rss,
          'peak_rss_mb': large_rss, 'small_s': small_s, 'seconds': large_s,
          'rss_per_input_byte': large_rss / (os.path.getsize(large) / 2**20)}


def main(argv=None) -> int:
  args = parse_args(argv)
  if not (math.isfinite(args.mb) and args.mb >= 1):
    print(f'error: --mb {args.mb} must be finite and at least 1', file=sys.stderr)
    return 2
  if os.path.exists(args.workdir):
    print(f'error: --workdir {args.workdir} exists: name a new directory (this run deletes '
          'it at the end)', file=sys.stderr)
    return 2
  os.makedirs(args.workdir)
  try:
    result = measure(args)
  finally:
    shutil.rmtree(args.workdir, ignore_errors=True)
  if args.json:
    print(json.dumps(result))
    return 0
  print(f'prepare of one {result["document_mb"]:.0f} MB {args.kind} document (tokenizer '
        f'{result["tokenizer"]}, 1 worker): peak RSS {result["peak_rss_mb"]:.0f} MB in '
        f'{result["seconds"]:.1f} s ({result["rss_per_input_byte"]:.2f} bytes of RSS per input '
        f'byte); a 1 kB document: {result["small_peak_rss_mb"]:.0f} MB in '
        f'{result["small_s"]:.1f} s')
  if args.kind == 'text' and args.mb == 200:
    print(f'target: peak RSS < {TARGET_MB} MB: '
          + ('met' if result['peak_rss_mb'] < TARGET_MB else 'NOT MET'))
  return 0


if __name__ == '__main__':
  sys.exit(main())
