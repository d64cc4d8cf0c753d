"""A 3-step run (without the optional extras) with a Hugging Face tokenizer, a profile trace
and the HLO; plots of runs."""

import glob
import gzip
import json
import os
import sys

import pytest

from tests.conftest import ROOT
from tests.test_cli import TINY
from trainer import plot, train
from trainer.hints import install_hint

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_profile_plot')

DEFAULT = os.path.join(ROOT, 'configs', 'default.py')
# The packages of the optional extras plot, tpu and hf (setup.py), blocked during the run below.
OPTIONAL = ('matplotlib', 'libtpu', 'torch', 'transformers')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """3 steps on text through a BPE tokenizer.json, traced from step 0, HLO dumped."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('profile')
  text = open(os.path.join(ROOT, 'trainer', 'loop.py'), encoding='utf-8').read()
  (root / 'corpus.txt').write_text(text * 3, encoding='utf-8')
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
  tok.train([str(root / 'corpus.txt')], trainers.BpeTrainer(
      vocab_size=400, special_tokens=['<|endoftext|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(root / 'tokenizer.json'))
  workdir = root / 'run'
  with pytest.MonkeyPatch.context() as m:
    for extra in OPTIONAL:  # training must not need them (make train leaves them out)
      m.setitem(sys.modules, extra, None)
    code = train.main(['--config', DEFAULT, '--workdir', str(workdir), *TINY,
                       '--config.steps=3', '--config.log_every=1', '--config.eval_every=2',
                       '--config.checkpoint.every=0', '--config.hardware.peak_flops=1e10',
                       f'--config.data.path={root / "corpus.txt"}',
                       f'--config.data.tokenizer={root / "tokenizer.json"}',
                       '--config.model.vocab_size=400', '--config.profile.start_step=0',
                       '--config.profile.num_steps=3', '--config.profile.dump_hlo=True'])
  assert code == 0
  return workdir


def test_trace_and_hlo_are_written(run):
  traces = glob.glob(str(run / 'profile' / 'plugins' / 'profile' / '*' / '*.xplane.pb'))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 1000
  perfetto = os.path.join(os.path.dirname(traces[0]), 'perfetto_trace.json.gz')
  with gzip.open(perfetto, 'rt') as f:
    events = json.load(f)['traceEvents']
  # the three steps ran inside the trace: the train step's executable appears
  assert sum('jit_train_step' in e.get('name', '') for e in events) >= 3
  hlo = (run / 'profile' / 'train_step.hlo.txt').read_text()
  assert hlo.startswith('HloModule jit_train_step') and 'is_scheduled=true' in hlo


def test_tokenized_run_reports_bits_per_byte(run):
  records = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
  evals = [r for r in records if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [2, 3]
  # bits per byte = nats per token x tokens per byte / ln 2; BPE has > 1 byte per token
  assert all(0 < r['eval_bpb'] < r['eval_loss'] / 0.6931 for r in evals)


def test_plot_writes_pngs(run, tmp_path, capsys):
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'metrics.jsonl').write_text('\n'.join(json.dumps(r) for r in [
      {'step': 1, 'loss': 6.0, 'tokens_per_sec': 900.0, 'mfu': 0.2},
      {'step': 2, 'loss': 5.5, 'tokens_per_sec': 950.0, 'mfu': 0.21},
      {'step': 2, 'eval_loss': 5.6}]) + '\n')
  out = tmp_path / 'plots'
  assert plot.main([str(run), str(other), '--out', str(out)]) == 0
  names = sorted(os.listdir(out))
  assert names == ['eval_bpb.png', 'loss.png', 'mfu.png', 'tokens_per_sec.png']
  for name in names:
    assert (out / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert os.path.getsize(out / name) > 5000
  assert plot.main([str(other), '--out', str(tmp_path / 'one')]) == 0
  assert 'eval_bpb.png: no run recorded eval_bpb; skipped' in capsys.readouterr().out
  assert plot.main([str(tmp_path / 'missing')]) == 2
  assert 'no metrics.jsonl' in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, 'matplotlib', None)  # its import now fails
  assert plot.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert err == f"error: plots need matplotlib: {install_hint('plot')}", err
