"""configs/smoke.py end to end: it trains, evaluates beside gzip and xz, and checkpoints."""

import contextlib
import io
import json
import os

import pytest

from tests.conftest import ROOT
from trainer import compression, train

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_smoke')

SMOKE = os.path.join(ROOT, 'configs', 'smoke.py')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """(workdir, exit status, what it printed) of one smoke run."""
  workdir, out = tmp_path_factory.mktemp('smoke') / 'run', io.StringIO()
  with contextlib.redirect_stdout(out):
    code = train.main(['--config', SMOKE, '--workdir', str(workdir)])
  return workdir, code, out.getvalue()


def test_smoke_config_trains_evaluates_and_checkpoints(run, capfd):
  workdir, code, _ = run
  assert code == 0
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  losses = [r['loss'] for r in records if 'loss' in r]
  evals = [r for r in records if 'eval_loss' in r]
  assert len(losses) == 4 and losses[-1] < losses[0]
  assert [r['step'] for r in evals] == [10, 20]
  assert evals[-1]['eval_bpb'] < evals[0]['eval_bpb'] < 8
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['10', '20']
  # A second run in the same workdir finds the last checkpoint: nothing left to do.
  assert train.main(['--config', SMOKE, '--workdir', str(workdir)]) == 0
  assert 'is already at step 20 (of 20): nothing to do' in capfd.readouterr().out


def test_eval_records_and_lines_carry_the_reference_compressors(run):
  workdir, _, printed = run
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  evals = [r for r in records if 'eval_loss' in r]
  # The same bytes at every eval (computed once): those the eval scores, 2 x 8 x 64 of them.
  assert {r['gzip_bpb'] for r in evals} == {evals[0]['gzip_bpb']}
  assert {r['xz_bpb'] for r in evals} == {evals[0]['xz_bpb']}
  assert 0 < evals[0]['xz_bpb'] and 0 < evals[0]['gzip_bpb'] < 8
  last = evals[-1]
  assert compression.describe(last) == (f" (gzip -9 {last['gzip_bpb']:.3f}, "
                                        f"xz -9e {last['xz_bpb']:.3f})")
  assert (f"step     20 | eval_loss {last['eval_loss']:.4f} eval_bpb {last['eval_bpb']:.3f}"
          f'{compression.describe(last)} | ') in printed
