r"""Blockwise attention against the plain one: peak temporary memory and time on CPU.

  python -m benchmarks.attention [--seq 4096] [--block 512] [--json]

Compiles the forward and backward pass (the gradient of a scalar loss with
respect to queries, keys and values) of ``model.attention='xla'`` (the whole
``[t, s]`` logits) and ``'blockwise'`` (models/attention.py) for one sequence of
``--seq`` tokens (packed documents, causal), and reports, side by side in one
run: the temporary bytes the compiler plans (``memory_analysis()``) and the
median wall time of repeated calls. Ratios are blockwise / xla. Targets
(issue "Ready for real accelerators"): memory at most 1/4, time at most 1.3x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks import prelude


def measure(fn, args, repeats: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  grad = jax.jit(jax.grad(lambda q, k, v, seg: jnp.sum(fn(q, k, v, seg) ** 2), argnums=(0, 1, 2)))
  compiled = grad.lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return {'temp_bytes': temp, 'median_seconds': statistics.median(times)}


def check(args) -> str | None:
  """What is wrong with the arguments, in one line; None when nothing is."""
  error = prelude.at_least_one(args, 'seq', 'block', 'heads', 'head_dim', 'repeats')
  if error:
    return error
  if args.seq < 4:
    return f'--seq={args.seq} must be at least 4 (four packed documents)'
  if args.seq % args.block:
    return f'--seq {args.seq} is not a multiple of --block {args.block}'
  return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m benchmarks.attention', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--seq', type=int, default=4096)
  parser.add_argument('--block', type=int, default=512)
  parser.add_argument('--heads', type=int, default=8)
  parser.add_argument('--head_dim', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--json', action='store_true')
  args = parser.parse_args(argv)
  error = check(args)
  if error:
    return prelude.refuse(error)
  prelude.start_cpu(1)
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from models.attention import attend_blockwise
  from models.transformer import attend
  # pylint: enable=g-import-not-at-top
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  shape = (1, args.seq, args.heads, args.head_dim)
  q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys)
  seg = (jnp.arange(args.seq) // (args.seq // 4))[None]  # four packed documents
  out = {'seq': args.seq, 'block': args.block, 'heads': args.heads, 'head_dim': args.head_dim,
         'platform': jax.devices()[0].platform}
  out['xla'] = measure(attend, (q, k, v, seg), args.repeats)
  out['blockwise'] = measure(lambda *a: attend_blockwise(*a, args.block), (q, k, v, seg),
                             args.repeats)
  out['memory_ratio'] = out['blockwise']['temp_bytes'] / out['xla']['temp_bytes']
  out['time_ratio'] = out['blockwise']['median_seconds'] / out['xla']['median_seconds']
  if args.json:
    print(json.dumps(out, indent=1))
    return 0
  print(f"attention fwd+bwd, seq {args.seq}, {args.heads} heads of {args.head_dim}, "
        f"{out['platform']} (measured, one run)")
  for name in ('xla', 'blockwise'):
    m = out[name]
    print(f"  {name:9s} temporaries {m['temp_bytes'] / 2**20:9.1f} MiB   "
          f"median {m['median_seconds'] * 1e3:8.1f} ms")
  print(f"  blockwise / xla: memory {out['memory_ratio']:.3f} (target <= 0.25), "
        f"time {out['time_ratio']:.2f}x (target <= 1.3)")
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
