"""One pricing (parallelism/pricing.py) for the planner's cost model and the step model."""

import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from parallelism import cost_model, einsum_plan, hardware, hlo_text, pricing, step_model
from tests.conftest import ROOT

HLO_READER = {'parallelism.step_model', 'parallelism.hlo_text', 'parallelism.kernels'}


@pytest.mark.parametrize('module', ['cost_model', 'pricing'])
def test_the_planner_pricing_imports_no_hlo_reader(module):
  # The package's __init__ imports collective_einsum and with it the modules the planner
  # runs beside (pair_sums.py imports kernels.py, an HLO reader), so the module is loaded
  # from a bare package of the same directory: what it imports, and nothing else, is loaded.
  code = (f'import importlib, sys, types\n'
          f'pkg = types.ModuleType("parallelism")\n'
          f'pkg.__path__ = [{os.path.join(ROOT, "parallelism")!r}]\n'
          f'sys.modules["parallelism"] = pkg\n'
          f'importlib.import_module("parallelism.{module}")\n'
          f'print(" ".join(m for m in sys.modules if m.startswith("parallelism.")))\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True, cwd=ROOT).stdout.split()
  assert f'parallelism.{module}' in out and 'parallelism.pricing' in out
  assert not HLO_READER & set(out), out


def test_the_cost_model_prices_transfers_as_the_step_model_does():
  # A 4-device ring over 'tensor' on v4: one step's transfer is the step model's price of
  # the collective-permute of its block, and the compiler's collective of 'none' its price
  # of the all-gather over one torus dimension (a group without chip coordinates).
  mesh = jax.sharding.AbstractMesh((1, 4), ('data', 'tensor'))
  eq, plans = einsum_plan.plan('bd,df->bf', P('tensor', None), P(None, 'tensor'),
                               P(None, 'tensor'))
  plan = next(p for p in plans if p.axis == 'tensor')
  est = cost_model.estimate(eq, plan, (64, 64), (64, 64), 'float32', mesh, 'tpu_v4')
  chip = step_model.Chip.from_profile('tpu_v4')
  block = 'f32[16,64]{1,0}'  # a device's rows of the gathered lhs
  permute = hlo_text.parse_instr(f'  %cp = {block} collective-permute(%x), '
                                 'source_target_pairs={{0,1},{1,2},{2,3},{3,0}}')
  gather = hlo_text.parse_instr('  %ag = f32[64,64]{1,0} all-gather(%x), '
                                'replica_groups={{0,1,2,3}}, dimensions={0}')
  assert est.step_transfer_seconds == pytest.approx(
      step_model.collective_seconds(permute, 4096, chip, 4))
  assert est.comm_seconds == pytest.approx(step_model.collective_seconds(gather, 4096, chip, 4))
  assert pricing.rates(hardware.get_profile('tpu_v4')) == (chip.matmul_rate, chip.link_rate,
                                                           chip.hbm_rate)
