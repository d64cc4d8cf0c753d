r"""What the paper's configs share: Llama-style decoders in bf16 on TPU v4 slices.

``configs/dense_10b.py``, ``dense_64b.py``, ``dense_500b.py`` and ``moe_1t.py``
start from it and set their size, batch, mesh, slice and the settings their
layout pays for; ``configs/v5p.py`` moves each to a v5p slice. The paper: Wang
et al., ASPLOS 2023 (10B to 1T parameters on up to 1024 TPU v4 chips). Not a
run of its own (its model is default.py's, its mesh and slice unset); it
converts and validates like any config (tests/test_config.py).
"""

import os

import ml_collections

from configs import default


def plan_path(name: str) -> str:
  """configs/plans/NAME.json, a plan file ``launch.aot --tune`` wrote for a paper config's
  layout: the weight-gradient rings the cost model does not pick (configs/plans/README.md).
  A plan is one layout's: a config that changes the layout sets ``parallelism.plan`` again,
  '' to plan anew (the planner alone)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'plans', f'{name}.json')


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.steps = 100_000                # the LR schedule's length (AOT compiles one step)
  c.eval_every = 1000

  c.model.vocab_size = 32768
  c.model.head_dim = 128
  c.model.max_seq_len = 2048
  c.model.norm_eps = 1e-5
  c.model.dtype = 'bfloat16'       # compute; master weights (param_dtype) stay float32
  c.model.scan_layers = True       # one compiled block, not one per layer
  c.model.scan_unroll = 1          # layers per scan iteration
  c.model.cast_in_loop = False     # the compiler casts all layers' weights before the scan
  c.model.attention = 'splash'     # the Pallas splash kernel, as MaxText on TPU
  c.model.fused_projections = True  # one einsum (and one ring) for q/k/v, one for gate/up

  c.optimizer.warmup_steps = 2000

  c.data.path = 'synthetic'        # point at real tokens (.npy/.bin) to train

  # 'auto': the cost model (hardware.name's profile) decides per layer.
  c.parallelism.collective_matmul = 'auto'

  c.hardware.name = 'tpu_v4'
  c.aot = ml_collections.ConfigDict()
  c.aot.topology = ''              # each config's slice (launch.aot's --topology overrides)
  return c
