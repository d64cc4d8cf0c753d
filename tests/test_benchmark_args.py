"""The benchmarks' arguments: a bad one is one line on stderr and exit 2, before JAX starts
or anything is written; benchmarks.input deletes only what its run made."""

import json
import os

import pytest

from benchmarks import attention, collective_einsum, data_quality, input as input_bench, moe
from benchmarks import train_step
from trainer import runtime


@pytest.mark.parametrize('module, args, expected', [
    (attention, ['--block', '0'], '--block=0 must be at least 1'),
    (attention, ['--seq', '1000'], '--seq 1000 is not a multiple of --block 512'),
    (attention, ['--repeats', '0'], '--repeats=0 must be at least 1'),
    (moe, ['--chunks', '2', '0'], '--chunks 0 must be at least 1'),
    (moe, ['--repeats', '0'], '--repeats=0 must be at least 1'),
    (collective_einsum, ['--repeats', '0'], '--repeats=0 must be at least 1'),
    (train_step, ['--repeats', '0'], '--repeats=0 must be at least 1'),
    (input_bench, ['--repeats', '0'], '--repeats=0 must be at least 1'),
    (input_bench, ['--shapes', '16x256', '16x256x3'], "--shapes '16x256x3' is not BATCHxSEQ_LEN"),
    (input_bench, ['--shapes', '0x256'], "--shapes '0x256' is not BATCHxSEQ_LEN"),
    (input_bench, ['--gib', '0'], '--gib 0 must be finite and at least'),
    (input_bench, ['--gib', 'nan'], '--gib nan must be finite'),
    (data_quality, ['--mb', '0'], '--mb 0 must be finite and > 0'),
    (data_quality, ['--max_doc_kb', '8'], '--max_doc_kb 8 is below --min_doc_kb 16'),
    (data_quality, ['--steps', '0'], '--steps=0 must be at least 1'),
    (data_quality, ['--seq_len', '2048'], '--seq_len=2048 is more than the model accepts'),
])
def test_bad_arguments_are_one_line_and_exit_2(module, args, expected, tmp_path, monkeypatch,
                                               capsys):
  monkeypatch.setattr(runtime, 'configure_host', lambda *a, **k: pytest.fail('JAX started'))
  monkeypatch.setattr(input_bench, 'measure', lambda *a: pytest.fail('measured'))
  monkeypatch.setattr(data_quality, 'measure', lambda *a: pytest.fail('measured'))
  if module in (input_bench, data_quality):
    args = args + ['--workdir', str(tmp_path / 'work')]
  assert module.main(args) == 2
  out, err = capsys.readouterr()
  assert out == '' and len(err.splitlines()) == 1, (out, err)
  assert err.startswith('error: ') and expected in err, err
  assert os.listdir(tmp_path) == []  # nothing written


def test_input_refuses_a_workdir_that_is_a_file(tmp_path, capsys):
  (tmp_path / 'file').write_text('precious')
  assert input_bench.main(['--workdir', str(tmp_path / 'file')]) == 2
  assert 'is a file, not a directory' in capsys.readouterr().err
  assert (tmp_path / 'file').read_text() == 'precious'


def test_input_deletes_only_what_its_run_made(tmp_path, monkeypatch, capsys):
  def measure(args):  # what a run writes: the corpora, their text, the train step's dir
    for name in ('text-small', 'small', 'train_step'):
      os.makedirs(os.path.join(args.workdir, name, 'sub'))
    with open(os.path.join(args.workdir, 'stray.txt'), 'w', encoding='utf-8') as f:
      f.write('x')
    return {'ran': True}
  monkeypatch.setattr(input_bench, 'measure', measure)
  workdir = tmp_path / 'existing'  # say, --workdir . or an earlier run's --keep
  (workdir / 'big-2gib').mkdir(parents=True)
  (workdir / 'notes.txt').write_text('precious')
  assert input_bench.main(['--workdir', str(workdir), '--json']) == 0
  assert json.loads(capsys.readouterr().out) == {'ran': True}
  assert sorted(os.listdir(workdir)) == ['big-2gib', 'notes.txt']
  assert (workdir / 'notes.txt').read_text() == 'precious'
  fresh = tmp_path / 'fresh'  # made by the run: deleted with it, also when the run fails
  monkeypatch.setattr(input_bench, 'measure', lambda args: measure(args) and 1 / 0)
  with pytest.raises(ZeroDivisionError):
    input_bench.main(['--workdir', str(fresh)])
  assert sorted(os.listdir(tmp_path)) == ['existing']
  monkeypatch.setattr(input_bench, 'measure', measure)
  assert input_bench.main(['--workdir', str(fresh), '--keep', '--json']) == 0
  assert 'stray.txt' in os.listdir(fresh)  # --keep: all of it stays
