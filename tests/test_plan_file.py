"""Plan files (parallelism/plan_file.py): a run writes the plan it ran, runs a saved plan
(parallelism.plan), resumes with its workdir's, and refuses a plan for another model."""

import argparse
import json
import os

import pytest

from parallelism import plan_file
from tests.test_cli import DEFAULT, TINY
from trainer import loop, train
from trainer.config import ConfigError

pytestmark = pytest.mark.xdist_group('test_plan_file')

# Every eligible layer a ring (one-way, the simplest schedule: the CPU planner's).
ALWAYS = TINY + ['--config.parallelism.collective_matmul=always', '--config.steps=2',
                 '--config.log_every=1', '--config.eval_every=0', '--config.checkpoint.every=2']


def _prepare(workdir, *overrides):
  return train.prepare(argparse.Namespace(config=DEFAULT, workdir=str(workdir)),
                       ALWAYS + list(overrides))


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A two-step run's workdir (plan.json and a checkpoint) and the plan it ran."""
  workdir = tmp_path_factory.mktemp('trained')
  run = _prepare(workdir)
  train.start_workdir(run, writer_enabled=True)
  loop.train(run)
  return workdir, dict(run.model.ops.plan)


def test_a_run_writes_the_plan_it_ran_and_it_reads_back_equal(trained):
  workdir, plan = trained
  saved = plan_file.read(os.path.join(workdir, 'plan.json'))
  assert saved['mesh'] == {'data': 4, 'fsdp': 1, 'tensor': 2, 'expert': 1}
  assert list(saved['layers']) == list(plan)
  for name, layer in plan.items():
    got = saved['layers'][name]
    assert (got.decision, got.specs, got.shapes) == layer, name
  assert any(l.decision.schedules[0] for l in plan.values())  # rings, with their schedules


def test_a_saved_plan_runs_as_saved_and_a_resume_runs_its_workdirs(trained, tmp_path, capsys):
  workdir, plan = trained
  # Mark one layer's saved decision: a run given the file, or resuming, must run it.
  data = json.loads((workdir / 'plan.json').read_text())
  data['layers']['unembed']['decision']['reason'] = 'from the plan file'
  edited = tmp_path / 'edited.json'
  edited.write_text(json.dumps(data))
  capsys.readouterr()
  given = _prepare(tmp_path / 'given', f'--config.parallelism.plan={edited}')
  assert given.model.ops.plan['unembed'].decision.reason == 'from the plan file'
  assert f'plan: runs {edited} as saved (no layer planned or measured)' in capsys.readouterr().out
  assert given.model.ops.plan['blocks.0.mlp.down'] == plan['blocks.0.mlp.down']
  (workdir / 'plan.json').write_text(json.dumps(data))
  resumed = _prepare(workdir, '--config.steps=4')
  assert resumed.resume_step == 2
  assert resumed.model.ops.plan['unembed'].decision.reason == 'from the plan file'
  assert f'plan: runs {workdir / "plan.json"} as saved' in capsys.readouterr().out
  fresh = _prepare(tmp_path / 'fresh')  # no checkpoint: it plans
  assert fresh.model.ops.plan['unembed'].decision.reason != 'from the plan file'
  assert 'as saved' not in capsys.readouterr().out


@pytest.mark.parametrize('overrides, message', [
    (['--config.model.mlp_dim=128'], "layer 'blocks.0.mlp.gate' runs with operand shapes "),
    (['--config.model.num_layers=2'], "layer 'blocks.1.attn.q' is not in the plan"),
    (['--config.mesh.data=2', '--config.mesh.tensor=4'], 'the plan is for mesh '),
])
def test_a_plan_for_another_model_or_mesh_is_refused_in_one_line(trained, tmp_path, overrides,
                                                                 message):
  workdir, _ = trained
  with pytest.raises(ConfigError) as e:
    _prepare(tmp_path, f'--config.parallelism.plan={workdir / "plan.json"}', *overrides)
  assert message in str(e.value) and '\n' not in str(e.value), e.value
  assert str(e.value).endswith("(--config.parallelism.plan='' plans anew)"), e.value


def test_a_resume_on_another_mesh_plans_anew_and_says_why(trained, tmp_path, capsys):
  # the checkpoint moves to another mesh; its workdir's plan, made for the old one, does not
  workdir, _ = trained
  moved = tmp_path / 'moved'
  moved.mkdir()
  for name in ('plan.json', 'checkpoints'):
    os.symlink(workdir / name, moved / name)
  capsys.readouterr()
  resumed = _prepare(moved, '--config.steps=4', '--config.mesh.data=2',
                     '--config.mesh.tensor=4')
  assert resumed.resume_step == 2
  assert f'plan: {moved / "plan.json"} does not fit this run (the plan is for mesh ' in (
      capsys.readouterr().out)


def test_a_plan_for_another_chip_is_refused_in_one_line(trained, tmp_path):
  # the same mesh and shapes, but chosen for another chip (a paper config's v4 plan on v5p)
  workdir, _ = trained
  data = json.loads((workdir / 'plan.json').read_text())
  assert data['hardware'] == 'cpu'
  other = tmp_path / 'v4.json'
  other.write_text(json.dumps({**data, 'hardware': 'tpu_v4'}))
  with pytest.raises(ConfigError) as e:
    _prepare(tmp_path / 'w', f'--config.parallelism.plan={other}')
  assert "the plan is for hardware 'tpu_v4', this run's is 'cpu'" in str(e.value), e.value


def test_a_file_that_is_no_plan_is_refused_in_one_line(tmp_path):
  bad = tmp_path / 'bad.json'
  bad.write_text('{"version": 1, "mesh": {}}')
  for path, message in ((bad, "is no plan file: KeyError: 'layers'"),
                        (tmp_path / 'none.json', 'is not a file')):
    with pytest.raises(ConfigError, match=message):
      _prepare(tmp_path / 'w', f'--config.parallelism.plan={path}')
