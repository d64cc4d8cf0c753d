r"""The comparators (baseline, xla) at their own best layouts, where that is not ours'.

  python -m launch.aot --config configs/comparators.py:dense_64b --variants baseline,xla

Issue 64 asks for ours over the faster comparator at each one's best layout. The argument
names a paper config on v4 (``configs/<name>.py``) whose comparators compile faster per token
at another layout than at the config's (which is ours' best); ``LAYOUTS`` holds that layout
and the search that found it. ``benchmarks.report`` compiles each beside its config and reads
the headline band against the faster of the comparators at either layout. The two configs not
here had their comparators' best at their own layout: ``dense_500b`` (``launch.aot --config
configs/dense_500b.py --search --variants baseline,xla --max_compiles 5``) and ``dense_10b``
(no tensor axis: all three variants compile one program). Figures: docs/results.md.
"""

import importlib

import ml_collections

LAYOUTS = {
    # launch.aot --config configs/dense_64b.py --search --variants baseline,xla
    # --max_compiles 6: without a tensor axis, twice the sequences, everything rematerialized.
    'dense_64b': {'mesh.data': 8, 'mesh.fsdp': 64, 'mesh.tensor': 1, 'batch_size': 1024,
                  'model.remat': 'full'},
    # No layout search (its grid has no expert axis); launch.aot --config configs/moe_1t.py
    # --variants xla --refine: two layers a scan iteration, no casts in it.
    'moe_1t': {'model.scan_unroll': 2, 'model.cast_in_loop': False},
}


def get_config(name: str = 'dense_64b') -> ml_collections.ConfigDict:
  if name not in LAYOUTS:
    raise ValueError(f'the argument is one of {sorted(LAYOUTS)}')  # the loader names it
  c = importlib.import_module(f'configs.{name}').get_config()
  c.update_from_flattened_dict(LAYOUTS[name])
  c.parallelism.plan = ''  # the config's plan is ours' at its own layout; here ours plans anew
  return c
