r"""Scores a checkpoint on held-out documents: eval_loss and bits per byte.

  python -m trainer.evaluate --checkpoint runs/mycorpus \
      [--config configs/default.py] [--config.data.eval_path=DIR] [--config.eval_steps=N ...]

The run config is the one the checkpoint recorded (the run that wrote it),
unless ``--config`` names a config file; ``--config.a.b=value`` overrides
either, e.g. ``data.eval_path`` to score another prepared corpus's held-out
documents, or ``eval_steps`` for more of them. The evaluation is the one
training runs (trainer/loop.py): ``eval_steps`` batches of ``batch_size`` x
``seq_len`` held-out tokens, the same each time, on the run's mesh; where the
held-out split fills fewer batches than ``eval_steps`` asks, as many as it fills
(a note on stderr says so). Prints one JSON line: checkpoint, step, eval_steps,
tokens scored, ``eval_loss`` (nats per token) and ``eval_bpb`` (bits per UTF-8
byte of text), and on byte-level data ``gzip_bpb`` and ``xz_bpb``, the reference
compressors' on the same bytes (trainer/compression.py). Bad input exits 2 with
one line; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from absl import logging as absl_logging

from trainer import checkpoint, config as config_lib, data, loop, train
from trainer.config import Config


def parse_args(argv):
  p = config_lib.add_help(argparse.ArgumentParser(prog='python -m trainer.evaluate',
                                                  description=__doc__))
  p.add_argument('--checkpoint', required=True, help='workdir, checkpoints/ or step directory')
  p.add_argument('--config', default='', help="config file, path.py[:arg] (default: the "
                 "checkpoint's run config)")
  return p.parse_known_args(argv)


def load_config(args, overrides) -> Config:
  """The run config (the checkpoint's, or ``--config``'s) with overrides; parameters from it."""
  values = (config_lib.load_dict(args.config) if args.config
            else checkpoint.peek_meta(args.checkpoint).get('config'))
  if values is None:
    raise config_lib.ConfigError(f'{args.checkpoint} records no run config (parameters only, '
                                 'e.g. from trainer.convert): pass --config')
  return config_lib.build(values, overrides).replace({'init_from': args.checkpoint})


def clamped_eval_steps(corpus: data.Data, cfg: Config) -> int:
  """``cfg.eval_steps``, or the held-out batches the split fills where that is fewer (noted)."""
  fits = data.eval_batches(corpus, cfg.batch_size, cfg.seq_len)
  if fits < cfg.eval_steps:
    print(f'note: the held-out split has {corpus.eval.num_tokens:,} tokens, {fits} batch(es) of '
          f'batch_size={cfg.batch_size} x seq_len={cfg.seq_len}: evaluating eval_steps={fits}, '
          f'not {cfg.eval_steps}', file=sys.stderr)
  return min(fits, cfg.eval_steps)


def main(argv=None) -> int:
  args, overrides = parse_args(argv)
  absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's notes on read-only checkpoints
  try:
    cfg = load_config(args, overrides)
    cfg.validate()  # eval_steps among the rest, before it is set aside for the check below
    with tempfile.TemporaryDirectory() as workdir:  # no checkpoints there: nothing resumes
      run = train.prepare_loaded(cfg.replace({'eval_steps': 1}), workdir)
    run.cfg = run.cfg.replace({'eval_steps': clamped_eval_steps(run.corpus, cfg)})
    s = loop.setup(run)  # restores the parameters: a corrupt array is found here
  except ValueError as e:  # ConfigError, a bad checkpoint (1 if corrupt)
    print(f'error: {str(e).strip(chr(34))}', file=sys.stderr)
    return getattr(e, 'exit_status', 2)
  record = loop._evaluate(s.eval_step, s.state.params, s.eval_batches)  # pylint: disable=protected-access
  cfg = run.cfg
  step = checkpoint.resolve(args.checkpoint)[1]
  print(json.dumps({'checkpoint': args.checkpoint, 'step': step, 'eval_steps': cfg.eval_steps,
                    'tokens': cfg.eval_steps * cfg.batch_size * cfg.seq_len,
                    'held_out': cfg.data.eval_path or cfg.data.path, **record,
                    **s.eval_reference}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
