r"""Plots of training runs from their metrics.jsonl: loss, eval bits per byte, tokens/s, MFU.

  python -m trainer.plot WORKDIR [WORKDIR ...] [--out DIR]

Writes ``loss.png`` (training loss, and eval loss dashed), ``eval_bpb.png``,
``tokens_per_sec.png`` and ``mfu.png`` against step, one line per run (labelled
by its workdir), to ``--out`` (default: ``WORKDIR/plots`` for one run,
``plots/`` for several). A plot whose metric no run recorded (``eval_bpb`` of
token-file data, say) is skipped and says so. Exit 2 on a workdir without
metrics.jsonl, or without matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainer.hints import install_hint

# (file name, title, y label, [(metric, line style, label suffix)])
PLOTS = (
    ('loss', 'Loss', 'nats per token', [('loss', '-', 'train'), ('eval_loss', '--', 'eval')]),
    ('eval_bpb', 'Held-out bits per byte', 'bits per byte', [('eval_bpb', '-', '')]),
    ('tokens_per_sec', 'Throughput', 'tokens / s', [('tokens_per_sec', '-', '')]),
    ('mfu', 'Model FLOPs utilization', 'MFU', [('mfu', '-', '')]),
)


def read_metrics(workdir: str) -> list[dict]:
  """The records of ``WORKDIR/metrics.jsonl``; raises ValueError when there are none."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.isfile(path):
    raise ValueError(f'{workdir}: no metrics.jsonl (is it a run\'s workdir?)')
  with open(path, encoding='utf-8') as f:
    records = [json.loads(line) for line in f if line.strip()]
  if not records:
    raise ValueError(f'{path} is empty')
  return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the records that hold ``key``."""
  rows = [(r['step'], r[key]) for r in records if key in r and 'step' in r]
  return [s for s, _ in rows], [v for _, v in rows]


def labels(workdirs: list[str]) -> list[str]:
  """Short names: the workdirs' base names, or whole paths where those repeat."""
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  return names if len(set(names)) == len(names) else [os.path.normpath(w) for w in workdirs]


def plot(workdirs: list[str], out_dir: str) -> list[str]:
  """Writes the PNGs; returns their paths."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:  # an optional extra: training does not need it
    raise ValueError(f'plots need matplotlib: {install_hint("plot")}') from None
  matplotlib.use('Agg')  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  # after use('Agg')
  runs = [(name, read_metrics(w)) for name, w in zip(labels(workdirs), workdirs)]
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for name, title, ylabel, metrics in PLOTS:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = 0
    for i, (run, records) in enumerate(runs):
      color = f'C{i % 10}'
      for key, style, suffix in metrics:
        steps, values = series(records, key)
        if steps:
          ax.plot(steps, values, style, color=color, marker='.' if len(steps) < 20 else None,
                  label=f'{run} {suffix}'.strip())
          lines += 1
    if not lines:
      plt.close(fig)
      print(f'{name}.png: no run recorded {" or ".join(k for k, _, _ in metrics)}; skipped')
      continue
    ax.set(title=title, xlabel='step', ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out_dir, f'{name}.png')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m trainer.plot', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('workdirs', nargs='+', metavar='WORKDIR')
  parser.add_argument('--out', default=None, help='output directory for the PNGs')
  args = parser.parse_args(argv)
  out = args.out or (os.path.join(args.workdirs[0], 'plots') if len(args.workdirs) == 1
                     else 'plots')
  try:
    written = plot(args.workdirs, out)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  for path in written:
    print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
