"""Paper-scale and accelerator configs, shape only: parameter counts, layouts, their slices."""

import argparse
import glob
import importlib.util
import json
import os
import re

import pytest
from benchmarks import report
from launch import aot, search
from models import attention
from models.transformer import count_params
from parallelism import mesh as mesh_lib
from tests.conftest import ROOT
from trainer import config as config_lib, validation
from trainer.state import abstract_model

# configs/<name>.py, and each on v5p (configs/v5p.py:<name>); the size in the name (10b,
# 1t) is what the count must match.
V4 = ['dense_10b', 'dense_64b', 'dense_500b', 'moe_1t']
CONFIGS = V4 + [f'v5p:{name}' for name in V4]


def _load(name):
  return config_lib.load(os.path.join(ROOT, report.config_arg(name)))


def _named_size(name: str) -> float:
  number, unit = re.search(r'(\d+)([bt])$', name).groups()
  return float(number) * {'b': 1e9, 't': 1e12}[unit]


@pytest.mark.parametrize('name', CONFIGS)
def test_parameter_count_within_3_percent_of_the_name(name):
  cfg = _load(name)
  # Abstract: shapes only, nothing allocated (as trainer/train.py checks a config).
  count = count_params(abstract_model(cfg.transformer()).params)
  assert abs(count / _named_size(name) - 1) <= 0.03, f'{name}: {count:,} parameters'


@pytest.mark.parametrize('name', CONFIGS)
def test_runs_as_a_user_would_on_its_tpu_slice(name):
  cfg = _load(name)
  assert cfg.hardware.name == ('tpu_v5p' if name.startswith('v5p:') else 'tpu_v4')
  assert (cfg.model.dtype, cfg.model.scan_layers, cfg.model.attention) == (
      'bfloat16', True, 'splash')
  assert cfg.model.remat in ('full', 'minimal', 'save_dot_except_mlp',  # each its best compiled
                             'save_dot_except_qkv')
  chip, chips = aot.parse_topology(cfg.aot.topology)
  assert chip.name == cfg.hardware.name
  sizes = mesh_lib.mesh_sizes(cfg.mesh.sizes(), chips)  # raises unless the mesh covers the slice
  assert sizes['fsdp'][1] > 1  # tensor may be 1 where the search found FSDP alone faster
  assert cfg.batch_size % (sizes['data'][1] * sizes['fsdp'][1]) == 0


def test_each_plan_file_is_a_paper_configs_own():
  """configs/plans/ holds the plans launch.aot --tune wrote for paper configs: each
  config's plan file is there, and each file there is some config's."""
  plans = {name: _load(name).parallelism.plan for name in CONFIGS}
  shipped = set(glob.glob(os.path.join(ROOT, 'configs', 'plans', '*.json')))
  assert shipped and shipped == {p for p in plans.values() if p}, plans


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None, reason='libtpu not installed')
@pytest.mark.parametrize('name', ['dense_64b', 'moe_1t', 'v5p:moe_1t'])
def test_a_plan_file_fits_its_config_on_its_slice(name, monkeypatch):
  """Planned on its slice with its plan file read (launch.aot's worker, nothing compiled),
  every layer of the config's model is in the plan as the plan has it: a change to the
  model, the mesh or the planner's record that the plan no longer fits fails here."""
  cfg = _load(name)
  monkeypatch.delenv('XLA_FLAGS', raising=False)  # the workers' own, as launch.aot's
  r = aot.run_worker(argparse.Namespace(config=report.config_arg(name)), [], 'ours',
                     cfg.aot.topology, ('', ''), ['--candidates', '[{}]'])
  assert 'error' not in r, r['error']
  with open(cfg.parallelism.plan, encoding='utf-8') as f:
    assert search.plan_key(r['plans'][0]) == search.plan_key(json.load(f))


@pytest.mark.parametrize('name', ['dense_64b', 'moe_1t'])
def test_the_comparators_layouts_lay_out_on_their_configs_slice(name):
  """configs/comparators.py: the config at another layout that still covers its slice, with
  no plan file (the config's is ours' at its own layout)."""
  own = _load(name)
  cfg = config_lib.load(os.path.join(ROOT, f'configs/comparators.py:{name}'))
  assert cfg.aot.topology == own.aot.topology and cfg.parallelism.plan == ''
  assert cfg.transformer() != own.transformer() or cfg.mesh != own.mesh or (
      cfg.batch_size != own.batch_size)
  _, chips = aot.parse_topology(cfg.aot.topology)
  sizes = mesh_lib.mesh_sizes(cfg.mesh.sizes(), chips)
  assert cfg.batch_size % (sizes['data'][1] * sizes['fsdp'][1]) == 0
  with pytest.raises(config_lib.ConfigError, match='one of'):
    config_lib.load(os.path.join(ROOT, 'configs/comparators.py:dense_10b'))


def test_v5p_names_a_bad_argument_once():
  with pytest.raises(config_lib.ConfigError) as e:
    _load('v5p:dense_1t')
  assert str(e.value).count('dense_1t') == 1 and 'one of' in str(e.value), e.value


@pytest.mark.parametrize('chips', [1, 4, 8])  # one GPU; a v4-8; a v5e-8 or eight GPUs
def test_the_single_host_config_fits_the_hosts_it_names(chips):
  cfg = _load('single_host')
  sizes = mesh_lib.mesh_sizes(cfg.mesh.sizes(), chips)
  cfg.validate()
  params = abstract_model(cfg.transformer()).params
  validation.check_layout(cfg, {a: d * i for a, (d, i) in sizes.items()}, params)
  assert abs(count_params(params) / 76e6 - 1) <= 0.03, count_params(params)
  model = cfg.model
  picked = {platform: attention.choose(model.attention, platform, model.dtype, model.head_dim,
                                       cfg.seq_len, model.attention_block)
            for platform in ('gpu', 'tpu')}
  assert picked == {'gpu': 'cudnn', 'tpu': 'splash'}
