r"""Overhead of decomposed collective einsums on CPU, side by side with ``none``.

  python -m benchmarks.collective_einsum [--json] [--repeats 5] [--small_only]

On CPU, collective-permutes are synchronous memory copies: decomposition cannot
hide anything there, so this measures its pure cost: ``overhead`` = median time
of the decomposed einsum / median time of the plain one (``mode="none"``, where
the compiler inserts the collective), for each mode, forward and
forward+backward, measured in one run, the modes taking turns
(``prelude.time_alternating``). Targets for the Transformer-shaped
cases: median overhead <= 1.05 forward and <= 1.10 forward+backward. Small
shapes are reported without a target, to show where decomposition stops paying
even before communication is counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks import prelude

MODES = ('none', 'unidirectional', 'bidirectional')

# name, equation, lhs shape, rhs shape, lhs spec, rhs spec, out spec (tensor axis = 8).
# A 1B-class layer: d_model 2048, MLP 8192, 16 heads of 128; 2048 tokens that every
# device of the tensor-parallel group works on (sequence-parallel activations).
T = 'tensor'
LARGE = [
    ('mlp_in  (AG)', 'td,df->tf', (2048, 2048), (2048, 8192), (T, None), (None, T), (None, T)),
    ('mlp_out (RS)', 'tf,fd->td', (2048, 8192), (8192, 2048), (None, T), (T, None), (T, None)),
    ('attn_qkv(AG)', 'td,dnh->tnh', (2048, 2048), (2048, 16, 128), (T, None), (None, T, None),
     (None, T, None)),
    ('attn_out(RS)', 'tnh,nhd->td', (2048, 16, 128), (16, 128, 2048), (None, T, None),
     (T, None, None), (T, None)),
]
SMALL = [
    ('small mlp_in  d=256', 'td,df->tf', (512, 256), (256, 1024), (T, None), (None, T), (None, T)),
    ('small mlp_out d=256', 'tf,fd->td', (512, 1024), (1024, 256), (None, T), (T, None), (T, None)),
]


def run_case(case, mesh, repeats):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from parallelism.collective_einsum import collective_einsum  # pylint: disable=g-import-not-at-top
  name, eq, ls, rs, lsp, rsp, osp = case
  lhs = jax.device_put(jax.random.normal(jax.random.key(0), ls), NamedSharding(mesh, P(*lsp)))
  rhs = jax.device_put(jax.random.normal(jax.random.key(1), rs), NamedSharding(mesh, P(*rsp)))
  ref = np.asarray(jnp.einsum(eq, lhs, rhs), np.float64)
  row = {'case': name, 'equation': eq, 'lhs': ls, 'rhs': rs, 'seconds': {}, 'max_rel_error': 0.0}
  passes = {'forward': [], 'forward_backward': []}
  for mode in MODES:
    f = lambda x, w, mode=mode: collective_einsum(
        eq, x, w, mesh=mesh, lhs_spec=P(*lsp), rhs_spec=P(*rsp), out_spec=P(*osp), mode=mode)
    fwd = jax.jit(f)
    passes['forward'].append(fwd)
    passes['forward_backward'].append(
        jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1))))
    out = np.asarray(fwd(lhs, rhs), np.float64)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    row['max_rel_error'] = max(row['max_rel_error'], err)
  for kind, fns in passes.items():  # the modes take turns: drift hits them alike
    for mode, t in zip(MODES, prelude.time_alternating(fns, (lhs, rhs), repeats)):
      row['seconds'].setdefault(mode, {})[kind] = t
  base = row['seconds']['none']
  row['overhead'] = {m: {k: row['seconds'][m][k] / base[k] for k in base}
                     for m in MODES if m != 'none'}
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--json', action='store_true', help='print one JSON object')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--small_only', action='store_true', help='skip the 1B-class cases')
  args = parser.parse_args(argv)
  error = prelude.at_least_one(args, 'repeats')
  if error:
    return prelude.refuse(error)
  prelude.start_cpu(8)
  from parallelism import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  mesh = mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=8, expert=1, dcn_data=1, dcn_fsdp=1,
                                 dcn_tensor=1, dcn_expert=1))
  large = [] if args.small_only else LARGE
  rows = []
  for case in large + SMALL:
    rows.append(run_case(case, mesh, args.repeats) | {'target': case in large})
    if not args.json:
      _print_row(rows[-1])
  summary = _summary([r for r in rows if r['target']])
  if args.json:
    print(json.dumps({'device_count': 8, 'repeats': args.repeats, 'cases': rows,
                      'summary': summary}, indent=1))
  else:
    print(json.dumps(summary, indent=1))
  return 0


def _summary(rows):
  """Median overhead over the target cases, per mode and pass, against the targets."""
  targets = {'forward': 1.05, 'forward_backward': 1.10}
  out = {}
  for mode in MODES[1:]:
    for kind, target in targets.items():
      values = [r['overhead'][mode][kind] for r in rows]
      if values:
        med = statistics.median(values)
        out[f'{mode}/{kind}'] = {'median_overhead': round(med, 4), 'target': target,
                                 'met': med <= target}
  return out


def _print_row(row):
  s = row['seconds']
  cells = '  '.join(f"{m[:4]} {s[m]['forward'] * 1e3:8.1f}/{s[m]['forward_backward'] * 1e3:8.1f}ms"
                    for m in MODES)
  over = '  '.join(f"{m[:4]} x{row['overhead'][m]['forward']:.3f}/x"
                   f"{row['overhead'][m]['forward_backward']:.3f}" for m in MODES[1:])
  print(f"{row['case']:22s} {cells} | overhead fwd/fwd+bwd {over} | err "
        f"{row['max_rel_error']:.1e}", flush=True)


if __name__ == '__main__':
  sys.exit(main())
