r"""Train-step time with decomposed dense layers vs plain ones, side by side.

  python -m benchmarks.train_step [--json] [--repeats 3]

For each config, compiles the real train step twice in one process,
``parallelism.collective_matmul=always`` and ``=never``, and reports median
step times over ``repeats`` steps (after one warm-up step) and their ratio,
with the number of decomposed layers and each program's collectives by kind. On
CPU communication is synchronous, so no transfer hides behind compute: this
measures what decomposition costs; target: ratio <= 1.05 for the 1B-class
config (configs/bench_tp_1b.py). The default config is reported without a
target. A ratio below 1 is no overlap: the CPU compiler lowers the plain
program's reduce-scatters to all-reduces (its collectives say so), which move
and add more than the rings do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks import prelude

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [('bench_tp_1b', os.path.join(ROOT, 'configs', 'bench_tp_1b.py'), 1.05),
           ('default', os.path.join(ROOT, 'configs', 'default.py'), None)]


def step_seconds(config_path: str, policy: str, repeats: int, workdir: str) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from parallelism import hlo_text  # pylint: disable=g-import-not-at-top
  from trainer import loop, train  # pylint: disable=g-import-not-at-top
  args = argparse.Namespace(config=config_path, workdir=workdir)
  run = train.prepare(args, [f'--config.parallelism.collective_matmul={policy}'])
  s = loop.setup(run)
  step = s.train_step.lower(s.state, s.get_batch(0)).compile()
  state = s.state
  times = []
  for i in range(repeats + 1):
    batch = s.get_batch(i)
    start = time.perf_counter()
    state, out = step(state, batch)
    jax.block_until_ready(out)  # one step in flight at a time (see trainer/loop.py)
    times.append(time.perf_counter() - start)
  decomposed = sum(d.mode != 'none' for d, *_ in s.ops.plan.values())
  return {'median_step_seconds': statistics.median(times[1:]), 'loss': float(out['loss']),
          'decomposed_layers': decomposed, 'dense_layers': len(s.ops.plan),
          'collectives': hlo_text.collective_counts(hlo_text.parse(step.as_text()))}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--json', action='store_true')
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args(argv)
  error = prelude.at_least_one(args, 'repeats')
  if error:
    return prelude.refuse(error)
  prelude.start_cpu(8)
  import tempfile  # pylint: disable=g-import-not-at-top
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, path, target in CONFIGS:
      row = {'config': name, 'target': target}
      for policy in ('never', 'always'):
        row[policy] = step_seconds(path, policy, args.repeats, os.path.join(tmp, name + policy))
      row['ratio'] = row['always']['median_step_seconds'] / row['never']['median_step_seconds']
      row['met'] = None if target is None else row['ratio'] <= target
      results.append(row)
      if not args.json:
        print(f"{name:12s} never {row['never']['median_step_seconds']:.3f}s  always "
              f"{row['always']['median_step_seconds']:.3f}s  ratio {row['ratio']:.3f}"
              f"{'' if target is None else f' (target <= {target})'}  decomposed layers "
              f"{row['always']['decomposed_layers']}/{row['always']['dense_layers']}", flush=True)
  if args.json:
    print(json.dumps({'device_count': 8, 'repeats': args.repeats, 'results': results}, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
