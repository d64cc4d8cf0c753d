"""Compiles a decomposed einsum for a small TPU slice (v4:2x2x2 by default) on this CPU machine.

Arguments: mode, kind ('ag' or 'rs' over tensor; 'wg': an FSDP layer, whose weight
gradient rings over fsdp), chip, a layer count (the gradient of a scan over
that many layers of the einsum; 0: the einsum alone), the rings' schedule settings
(parallelism/schedule.py) ``additions`` (default ``apart``) and ``pairs`` (default
``joined``), the decision's ``ring_order`` (default '': none) and ``unroll`` (default 1). Run by tests/test_tpu_aot.py in its
own process: LIBTPU_INIT_ARGS (which turns XLA's own windowed einsum off) is read once per
process. Prints the scheduled TPU HLO.
"""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from jax.experimental import topologies  # pylint: disable=wrong-import-position
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=wrong-import-position

from parallelism import hardware, mesh as mesh_lib, report  # pylint: disable=wrong-import-position
from parallelism.collective_einsum import run_decision  # pylint: disable=wrong-import-position
from parallelism.decision import explain  # pylint: disable=wrong-import-position


# A small slice of each TPU chip in parallelism/hardware.py's table.
SLICES = {'tpu_v4': 'v4:2x2x2', 'tpu_v5p': 'v5p:2x2x2', 'tpu_v5e': 'v5e:2x4', 'tpu_v6e': 'v6e:2x4'}


def main(mode: str, kind: str, chip: str = 'tpu_v4', layers: str = '0',
         ring_additions: str = 'apart', gather_pairs: str = 'joined', ring_order: str = '',
         unroll: str = '1'):
  layers = int(layers)
  tpu = hardware.get_profile(chip).tpu
  topo = topologies.get_topology_desc(platform='tpu', topology_name=SLICES[chip],
                                      chip_config_name=tpu.chip_config_name,
                                      chips_per_host_bounds=tpu.chips_per_host_bounds,
                                      num_slices=1)
  t = 'fsdp' if kind == 'wg' else 'tensor'
  mesh = mesh_lib.make_mesh(dict(data=1, fsdp=1, tensor=1, expert=1, dcn_data=1, dcn_fsdp=1,
                                 dcn_tensor=1, dcn_expert=1) | {t: -1}, topo.devices)
  if kind == 'wg':  # an FSDP layer: the weight gathered over fsdp, its gradient scattered
    eq, ls, rs, specs = 'td,df->tf', (8192, 4096), (4096, 4096), (P(t, None), P(t, None), P(t, None))
  elif kind == 'ag':
    eq, ls, rs, specs = 'td,df->tf', (8192, 4096), (4096, 16384), (P(t, None), P(None, t), P(None, t))
  else:
    eq, ls, rs, specs = 'tf,fd->td', (8192, 16384), (16384, 4096), (P(None, t), P(t, None), P(t, None))
  kw = dict(mesh=mesh, lhs_spec=specs[0], rhs_spec=specs[1], out_spec=specs[2])
  prefer = {'additions': ring_additions, 'pairs': gather_pairs, 'unroll': int(unroll)}
  decide = lambda x, w: dataclasses.replace(
      explain(eq, x.shape, w.shape, x.dtype, mode=mode, prefer=prefer, **kw),
      ring_order=ring_order)
  einsum = lambda x, w: run_decision(decide(x, w), x, w, **kw)
  # the rings the plan runs as kernels, labelled as launch.aot labels them ('-' no layer)
  planned = report.kernel_rings({'-': (decide(*(jax.ShapeDtypeStruct(s, jnp.bfloat16)
                                                for s in (ls, rs))), specs)})
  print('planned kernels: ' + json.dumps([k.split(': ', 1)[1] for k in planned]),
        file=sys.stderr)
  f = jax.jit(einsum)
  arg_specs = specs
  if layers:  # the gradient of a scan over stacked weights, as a train step's layers
    rs, arg_specs = (layers,) + rs, (specs[0], P(None, *specs[1]))

    def loss(x, ws):
      def layer(h, w):
        return h * jnp.mean(einsum(h, w)), None
      return jnp.sum(jax.lax.scan(layer, x, ws)[0].astype(jnp.float32))
    f = jax.jit(jax.grad(loss, argnums=1))
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
          for s, p in ((ls, arg_specs[0]), (rs, arg_specs[1]))]
  print(f.lower(*args).compile().as_text())


if __name__ == '__main__':
  main(*sys.argv[1:])
