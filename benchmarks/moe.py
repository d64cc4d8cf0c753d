r"""MoE layer time with the expert all-to-all chunked vs single, side by side.

  python -m benchmarks.moe [--json] [--repeats 3] [--chunks 2 4]

One MoE layer (models/moe.py) on 8 CPU devices, mesh data=2 x expert=4, with
2048 tokens per device (16 sequences of 1024) and d_model 1024: 8 experts,
top-2, expert MLP width 1024, capacity factor 1.25. For each chunk count the
layer is compiled with ``parallelism.collective_matmul=never`` (one all-to-all
each way) and ``always`` (``moe.overlap_chunks`` chunks), and timed forward and
forward+backward, the two modes alternating, median over ``repeats``. On CPU
all-to-alls are synchronous copies, so this measures what chunking costs;
target: ratio (chunked / single) <= 1.10. The chunk shapes used are printed.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import prelude

TARGET = 1.10
SHAPE = dict(sequences=16, seq_len=1024, d_model=1024, experts=8, top_k=2, mlp_dim=1024)
RULES = [['batch', ['data', 'fsdp', 'expert']], ['batch', ['data', 'fsdp']],
         ['exp', 'expert'], ['mlp', 'tensor']]


def build(policy: str, chunks: int):
  """(forward, forward+backward, params, x, decision) for one policy."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from models.moe import MoeConfig, MoeMlp  # pylint: disable=g-import-not-at-top
  from models.transformer import RESIDUAL  # pylint: disable=g-import-not-at-top
  from parallelism import mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top
  mesh = mesh_lib.make_mesh(dict(data=2, fsdp=1, tensor=1, expert=4, dcn_data=1, dcn_fsdp=1,
                                 dcn_tensor=1, dcn_expert=1))
  rules, policy = sharding.normalize_rules(RULES), sharding.MatmulPolicy(policy)
  moe = MoeConfig(num_experts=SHAPE['experts'], top_k=SHAPE['top_k'],
                  mlp_dim=SHAPE['mlp_dim'], overlap_chunks=chunks)
  make_layer = lambda ops: MoeMlp(moe, SHAPE['d_model'], 2, 'float32', 'float32', ops,
                                  nnx.Rngs(0))
  x_shape = (SHAPE['sequences'], SHAPE['seq_len'], SHAPE['d_model'])
  plan = sharding.plan_layers(lambda ops: make_layer(ops)(jnp.zeros(x_shape), RESIDUAL),
                              mesh=mesh, rules=rules, policy=policy)
  ops = sharding.ShardedOps(mesh, rules, policy, plan)
  layer = make_layer(ops)
  graphdef, params = nnx.split(layer)
  x = jax.random.normal(jax.random.key(1), x_shape, jnp.float32)
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, ops.spec(('batch', 'length', 'embed'))))

  def forward(params, x):
    return nnx.merge(graphdef, params)(x, RESIDUAL)[0]

  def loss(params, x):
    return jnp.mean(forward(params, x) ** 2)

  fwd = jax.jit(forward)
  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return fwd, fwd_bwd, params, x, plan['moe.exchange'].decision


def run(chunks: int, repeats: int) -> dict:
  single = build('never', chunks)
  chunked = build('always', chunks)
  row = {'chunks': chunks, 'chunk_shape_e_b_c_d': list(chunked[4].chunk_shape),
         'single_shape_e_b_c_d': list(single[4].chunk_shape)}
  for name, index in (('forward', 0), ('forward_backward', 1)):
    t_single, t_chunked = prelude.time_alternating([single[index], chunked[index]],
                                                   single[2:4], repeats)
    row[name] = {'single_seconds': t_single, 'chunked_seconds': t_chunked,
                 'ratio': t_chunked / t_single}
  row['met'] = all(row[n]['ratio'] <= TARGET for n in ('forward', 'forward_backward'))
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--json', action='store_true')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--chunks', type=int, nargs='+', default=[2, 4])
  args = parser.parse_args(argv)
  bad = [f'--repeats={args.repeats}'] if args.repeats < 1 else []
  bad += [f'--chunks {c}' for c in args.chunks if c < 1]
  if bad:
    return prelude.refuse(f'{bad[0]} must be at least 1')
  prelude.start_cpu(8)
  tokens = SHAPE['sequences'] * SHAPE['seq_len'] // 8
  if not args.json:
    print(f'MoE layer, 8 CPU devices (data=2 x expert=4), {tokens} tokens per device, '
          f'{SHAPE}; target ratio <= {TARGET}', flush=True)
  results = []
  for chunks in args.chunks:
    row = run(chunks, args.repeats)
    results.append(row)
    if not args.json:
      print(f"chunks {chunks}: chunk [e,b,c,d] {row['chunk_shape_e_b_c_d']} (single "
            f"{row['single_shape_e_b_c_d']}); forward {row['forward']['single_seconds']:.3f}s "
            f"-> {row['forward']['chunked_seconds']:.3f}s ratio {row['forward']['ratio']:.3f}; "
            f"fwd+bwd {row['forward_backward']['single_seconds']:.3f}s -> "
            f"{row['forward_backward']['chunked_seconds']:.3f}s ratio "
            f"{row['forward_backward']['ratio']:.3f}", flush=True)
  if args.json:
    print(json.dumps({'device_count': 8, 'tokens_per_device': tokens, 'shape': SHAPE,
                      'target': TARGET, 'repeats': args.repeats, 'results': results}, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
