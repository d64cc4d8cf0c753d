"""Papercuts: printed commands that work as printed, hints by meaning, quiet output."""

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest

from parallelism import cli, report, sharding
from tests.conftest import ROOT
from tests.test_cli import DEFAULT, TINY
from tests.test_metrics import _row
from tests.test_prepare import _word_tokenizer
from tests.test_readme import COMMANDS
from trainer import checkpoint, config as config_lib, convert, hints, optim, plot, prepare, train

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_papercuts')

# ---- commands ---------------------------------------------------------------------------


def test_prepare_prints_a_train_command_that_runs_after_make_train(tmp_path, monkeypatch,
                                                                    capsys):
  """Its own workdir (make train's runs/default holds checkpoints of other data), the
  interpreter and config by paths that work from here, and a vocabulary for the tokenizer."""
  monkeypatch.chdir(tmp_path)
  spec = _word_tokenizer(tmp_path / 'tok', 300)
  (tmp_path / 'in.jsonl').write_text(''.join(
      json.dumps({'text': ' '.join(f'doc{(i * j) % 298}' for j in range(12))}) + '\n'
      for i in range(10000)))  # held out: enough for the default config's evals
  assert prepare.main(['--input', 'in.jsonl', '--output', 'data/words', '--tokenizer', spec,
                       '--eval_fraction', '0.35', '--workers', '2']) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert line.startswith('train on it: '), line
  argv = shlex.split(line[len('train on it: '):])
  assert argv[:3] == [sys.executable, '-m', 'trainer.train']  # outside the clone: absolute
  assert argv[3:] == ['--config', DEFAULT, '--workdir', 'runs/words',
                      '--config.data.path=data/words',
                      f'--config.data.tokenizer={os.path.abspath(spec)}',
                      '--config.model.vocab_size=384']
  run = train.prepare(*train.parse_args(argv[3:]))  # everything a run checks before compiling
  assert run.workdir == 'runs/words' and run.cfg.data.path == 'data/words'
  assert run.resume_step is None


def test_the_train_command_is_relative_inside_the_clone(monkeypatch):
  monkeypatch.chdir(ROOT)
  tok = {'byte_level': True, 'path': '', 'vocab_size': 257}
  argv = shlex.split(prepare.train_command('data/default', tok))
  assert argv[1:] == ['-m', 'trainer.train', '--config', 'configs/default.py', '--workdir',
                      'runs/default_corpus', '--config.data.path=data/default']
  inside = not os.path.relpath(sys.executable).startswith('..')  # e.g. .venv/bin/python
  assert argv[0] == (os.path.relpath(sys.executable) if inside else sys.executable)


@pytest.fixture(scope='module')
def stopped_run(tmp_path_factory):
  """A tiny run of the embedded corpus stopped at step 2 of 4, and how to continue it."""
  workdir = tmp_path_factory.mktemp('stopped') / 'run'
  argv = ['--config', DEFAULT, '--workdir', str(workdir), *TINY, '--config.eval_every=0',
          '--config.checkpoint.every=1', '--config.steps=4']
  assert train.main(argv + ['--config.stop_after=2']) == 0
  return workdir, argv


def test_a_resume_on_other_data_is_refused_naming_the_paths_as_set(stopped_run, tmp_path,
                                                                   capsys):
  workdir, argv = stopped_run
  (tmp_path / 'in').mkdir()
  for i in range(40):
    (tmp_path / 'in' / f'{i}.txt').write_text(f'document {i} ' * 60)
  corpus = str(tmp_path / 'corpus')
  assert prepare.main(['--input', str(tmp_path / 'in/*.txt'), '--output', corpus,
                       '--eval_fraction', '0.3', '--workers', '1']) == 0
  capsys.readouterr()
  assert train.main(argv + [f'--config.data.path={corpus}']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert (f"has checkpoints of another run (data.path: '' in the checkpoint, {corpus!r} now; "
          "data sampling: 'windows' in the checkpoint, 'shuffled sequences' now)") in err, err
  assert 'None' not in err


def test_a_resume_that_changes_the_schedule_says_so(stopped_run, tmp_path, capsys):
  workdir, argv = stopped_run[0], list(stopped_run[1])
  shutil.copytree(workdir, tmp_path / 'run')
  argv[argv.index('--workdir') + 1] = str(tmp_path / 'run')
  capsys.readouterr()
  assert train.main(argv + ['--config.steps=8', '--config.stop_after=3']) == 0
  opt = config_lib.load(DEFAULT).optimizer
  was, now = (float(optim.learning_rate_schedule(opt, steps)(2)) for steps in (4, 8))
  assert was != now
  lines = [l for l in capsys.readouterr().out.splitlines() if 'schedule' in l]
  assert lines == ["the learning-rate schedule differs from the checkpoint's (steps 4 -> 8): "
                   f'the learning rate at step 2 is {now:.3g} ({was:.3g} on the old schedule)']


def test_the_schedule_change_names_each_key_and_nothing_when_unchanged():
  cfg = config_lib.load(DEFAULT)
  before = cfg.to_dict()
  assert optim.schedule_change(before, cfg.steps, cfg.optimizer, 100) is None
  assert optim.schedule_change(None, 1000, cfg.optimizer, 100) is None  # nothing recorded
  other = cfg.replace({'optimizer.learning_rate': 1e-3, 'optimizer.schedule': 'constant'})
  line = optim.schedule_change(before, cfg.steps, other.optimizer, 100)
  assert line.startswith("the learning-rate schedule differs from the checkpoint's "
                         '(optimizer.learning_rate 0.004 -> 0.001, optimizer.schedule cosine '
                         '-> constant): the learning rate at step 100 is 0.001 ('), line


# ---- hints ------------------------------------------------------------------------------


@pytest.mark.parametrize('key, meant', [
    ('optimizer.lr', 'optimizer.learning_rate'), ('lr', 'optimizer.learning_rate'),
    ('bs', 'batch_size'), ('batch', 'batch_size'), ('optimizer.wd', 'optimizer.weight_decay'),
    ('weight_decay', 'optimizer.weight_decay'), ('warmup', 'optimizer.warmup_steps'),
    ('max_steps', 'steps'), ('num_steps', 'steps'), ('train_steps', 'steps'),
    ('seq_length', 'seq_len'), ('context', 'seq_len'), ('block_size', 'seq_len'),
    ('model.n_layer', 'model.num_layers'), ('d_model', 'model.d_model'),
    ('model.n_embd', 'model.d_model'), ('model.hidden_size', 'model.d_model'),
    ('model.n_head', 'model.num_heads'), ('moe.intermediate_size', 'moe.mlp_dim'),
    ('optimizer.lerning_rate', 'optimizer.learning_rate'),  # spelling, as before
])
def test_an_unknown_key_is_matched_by_meaning_then_spelling(key, meant):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load(DEFAULT, [f'--config.{key}=1'])
  assert str(e.value).endswith(f' (did you mean config.{meant}?)'), e.value


@pytest.mark.parametrize('args, message', [
    (['--config.optimizer.lr=1e-3'],
     'unknown config key: config.optimizer.lr (did you mean config.optimizer.learning_rate?)'),
    (['--steps=10'], 'unrecognized argument: --steps=10 (did you mean --config.steps=10?)'),
    (['--lr', '1e-3'],
     'unrecognized argument: --lr (did you mean --config.optimizer.learning_rate?)'),
    (['--bogus'], 'unrecognized argument: --bogus'),
])
def test_a_bad_argument_exits_2_with_the_key_it_means(tmp_path, capsys, args, message):
  assert train.main(['--config', DEFAULT, '--workdir', str(tmp_path / 'run'), *args]) == 2
  assert capsys.readouterr().err.strip() == f'error: {message}'
  assert not (tmp_path / 'run').exists()


def test_a_missing_config_file_lists_the_configs(monkeypatch, capsys):
  monkeypatch.chdir(ROOT)
  assert train.main(['--config', 'configs/defualt.py']) == 2
  err = capsys.readouterr().err.strip()
  names = sorted(n for n in os.listdir(os.path.join(ROOT, 'configs'))
                 if n.endswith('.py') and n != '__init__.py')
  assert err == ('error: config file not found: configs/defualt.py (did you mean '
                 'configs/default.py?); the configs in configs/: ' + ', '.join(names)), err


def test_the_extras_hint_is_the_makefiles_install():
  with open(os.path.join(ROOT, 'Makefile'), encoding='utf-8') as f:
    make = dict(re.findall(r'^(\w+) :?= (.*)$', f.read(), re.M))
  install = make['INSTALL'].replace('$(PY)', make['PY']).replace('$(VENV)', make['VENV'])
  assert install.replace(' --quiet', '') == hints.PIP_INSTALL
  assert hints.install_hint('plot') == (
      ".venv/bin/python -m pip install -c constraints.txt -e '.[plot]'")
  plain = []
  for part in ('trainer', 'launch', 'benchmarks', 'parallelism', 'models'):
    for folder, _, files in os.walk(os.path.join(ROOT, part)):
      for name in (n for n in files if n.endswith('.py')):
        with open(os.path.join(folder, name), encoding='utf-8') as f:
          plain += [os.path.join(folder, name)] if 'pip install -e' in f.read() else []
  assert not plain, f'a hint with plain pip: {plain}'


@pytest.mark.parametrize('extra, modules, call', [
    ('plot', ['matplotlib'], lambda: plot.plot([], '.')),
    ('data', ['pyarrow.parquet'], prepare._parquet),  # pylint: disable=protected-access
    ('hf', ['torch', 'transformers'],
     convert._import_torch_transformers),  # pylint: disable=protected-access
])
def test_a_missing_extra_names_the_venvs_pip_with_constraints(monkeypatch, extra, modules,
                                                               call):
  for module in modules:
    monkeypatch.setitem(sys.modules, module, None)  # its import now fails
  with pytest.raises(ValueError) as e:
    call()
  assert str(e.value).endswith(
      f": .venv/bin/python -m pip install -c constraints.txt -e '.[{extra}]'"), e.value


# ---- output -----------------------------------------------------------------------------


def test_a_report_piped_into_head_ends_without_a_traceback(tmp_path):
  # More rows than a pipe holds (64 KiB): the writer is still writing when the reader goes.
  rows = [_row(f'blocks.{i}.attn.q', 'unidirectional') for i in range(3000)]
  report.write(str(tmp_path / 'parallelism_report.json'), rows,
               sharding.MatmulPolicy('auto', hardware='tpu_v4'))
  proc = subprocess.Popen([sys.executable, '-m', 'parallelism.report', str(tmp_path)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline().split()[:2] == ['layer', 'einsum']
  proc.stdout.close()  # as head does after its lines
  err = proc.stderr.read()
  assert proc.wait(timeout=120) == cli.BROKEN_PIPE_STATUS and err == '', err


def test_reading_a_checkpoint_logs_no_absl_warnings(tmp_path, caplog):
  """What fine-tuning's init_from and hf-export do: orbax's read_only manager warned thrice."""
  params = {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}
  checkpoint.write_params(str(tmp_path / 'ckpt'), params, {'d_model': 3})
  with caplog.at_level(logging.WARNING):
    model, read = checkpoint.read_params(str(tmp_path / 'ckpt'))
  assert model == {'d_model': 3}
  np.testing.assert_array_equal(read['w'], params['w'])
  assert not [r.getMessage() for r in caplog.records if r.name == 'absl'], caplog.text


def test_gitignore_covers_what_the_readmes_commands_write():
  flags = ('--workdir', '--output', '--out_dir', '--out')
  written = {arg.split('=', 1)[-1] if '=' in arg else argv[i + 1]
             for argv in COMMANDS for i, arg in enumerate(argv[:-1])
             if arg in flags or arg.split('=')[0] in flags}
  written = sorted(p for p in written if not p.startswith(('/', '$', '~')) and p != p.upper())
  assert {'data/mycorpus', 'ckpt/llama', 'hf/finetuned', 'runs/plots'} <= set(written), written
  proc = subprocess.run(['git', 'check-ignore', '--no-index', *written, 'data/x', 'ckpt/x',
                         'hf/x'], cwd=ROOT, capture_output=True, text=True, check=False)
  assert sorted(proc.stdout.split()) == sorted(written + ['data/x', 'ckpt/x', 'hf/x']), proc
  kept = subprocess.run(['git', 'check-ignore', '--no-index', 'tests/data/x.json'], cwd=ROOT,
                        capture_output=True, text=True, check=False)
  assert kept.returncode == 1 and not kept.stdout  # tests/data is tracked
