"""Inputs a user names: only regular files, inside --hf_dir, decodable text, ids the model has,
values that cannot end in NaN, paths the file system holds, and prepare's bounded pieces.

A FIFO test cannot hang the suite: ``fifo`` lets go of a reader that opened it (EOF) within
a second, so a check that regressed fails its test instead of blocking it.
"""

import errno
import json
import os
import re
import threading

import numpy as np
import pytest

from tests import test_prepare
from tests.conftest import ROOT
from trainer import config, convert, data, generate, prepare, tokenizer, train, validation

DEFAULT = os.path.join(ROOT, 'configs', 'default.py')


@pytest.fixture
def fifo(tmp_path):
  """A FIFO ``pipe.txt``; a reader blocked on it is given end-of-file within a second."""
  path = tmp_path / 'pipe.txt'
  os.mkfifo(path)
  done = threading.Event()

  def release():
    while not done.wait(1):
      try:  # succeeds only while a reader waits in open()
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
      except OSError:
        pass
  threading.Thread(target=release, daemon=True).start()
  yield path
  done.set()


def _prepare(*argv):
  return prepare.main([*map(str, argv), '--workers', '1'])


def _one_line(capsys) -> str:
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and '\n' not in err, err
  return err


# ------------------------------------------------------------- regular files only

@pytest.mark.parametrize('special, kind', [('fifo', 'a FIFO (named pipe)'),
                                           ('/dev/zero', 'a character device')])
def test_prepare_refuses_what_is_not_a_regular_file_before_reading(tmp_path, fifo, capsys,
                                                                    special, kind):
  (tmp_path / 'ok.txt').write_text('text')
  path = fifo if special == 'fifo' else special
  assert _prepare('--input', tmp_path / 'ok.txt', path, '--output', tmp_path / 'out') == 2
  assert _one_line(capsys) == (f"error: --input '{path}' names {path}: {kind}, not a regular "
                               'file (only regular files are read)')
  assert not (tmp_path / 'out').exists()


def test_the_data_reader_refuses_a_fifo(tmp_path, fifo):
  with pytest.raises(ValueError, match=r"^data.path='.*/\*.txt' names .*pipe.txt: a FIFO"):
    data.load(config.Data(path=str(tmp_path / '*.txt')), 264, 0)


def test_hf_import_refuses_a_fifo_and_a_link_out_of_hf_dir(tmp_path, fifo, capsys):
  hf, out = tmp_path / 'hf', tmp_path / 'out'
  hf.mkdir()
  (hf / 'config.json').write_text(json.dumps({'vocab_size': 8}))
  os.rename(fifo, hf / 'model.safetensors')
  assert convert.main(['hf-import', '--hf_dir', str(hf), '--out_dir', str(out)]) == 2
  assert _one_line(capsys) == (f'error: --hf_dir: {hf}/model.safetensors: a FIFO (named '
                               'pipe), not a regular file (only regular files are read)')
  os.remove(hf / 'model.safetensors')
  (tmp_path / 'id_rsa').write_text('PRIVATE KEY')
  os.symlink(tmp_path / 'id_rsa', hf / 'tokenizer.json')
  assert convert.main(['hf-import', '--hf_dir', str(hf), '--out_dir', str(out)]) == 2
  assert _one_line(capsys) == (f'error: --hf_dir: {hf}/tokenizer.json resolves to '
                               f'{tmp_path}/id_rsa, outside {hf}: only files inside it are read')
  assert not out.exists()


# ------------------------------------------------------------ text a tokenizer reads

def _word_tokenizer(directory):
  """A word-level tokenizer.json: [UNK] 0, [END] 1 (its end of document), w0.. w297."""
  return test_prepare._word_tokenizer(directory, 300, 'w')  # pylint: disable=protected-access


def test_undecodable_text_is_refused_or_replaced_and_counted(tmp_path, capsys):
  spec = _word_tokenizer(tmp_path / 'tok')
  (tmp_path / 'latin1.txt').write_bytes('w1 w2 caf\u00e9 w3 na\u00efve'.encode('latin-1'))
  args = ['--input', tmp_path / 'latin1.txt', '--tokenizer', spec, '--eval_fraction', '0']
  assert _prepare(*args, '--output', tmp_path / 'out') == 2
  assert _one_line(capsys).startswith(f'error: {tmp_path}/latin1.txt at byte 9: not UTF-8 '
                                      '(invalid continuation byte)')
  assert not (tmp_path / 'out').exists()
  assert _prepare(*args, '--output', tmp_path / 'out', '--errors', 'replace') == 0
  assert 'replaced 2 undecodable byte sequence(s)' in capsys.readouterr().out
  manifest, split = data.open_prepared(str(tmp_path / 'out'), 'train')
  assert manifest['replaced'] == 2 and split.tokens().tolist() == [3, 4, 0, 0, 5, 0, 0, 0, 1]
  # Half a surrogate pair, which JSON can escape and UTF-8 cannot hold.
  (tmp_path / 'in.jsonl').write_text('{"text": "w1"}\n{"text": "w1 \\ud83d w2"}\n')
  args[1] = tmp_path / 'in.jsonl'
  assert _prepare(*args, '--output', tmp_path / 'j') == 2
  assert _one_line(capsys) == (f"error: {tmp_path}/in.jsonl at byte 15: character 3 of the "
                               "text is '\\ud83d', half a surrogate pair, which UTF-8 cannot "
                               "hold (prepare's --errors=replace replaces and counts such "
                               'characters)')
  assert _prepare(*args, '--output', tmp_path / 'j', '--errors', 'replace') == 0
  manifest, split = data.open_prepared(str(tmp_path / 'j'), 'train')
  assert manifest['replaced'] == 1 and split.tokens().tolist() == [3, 1, 3, 0, 4, 1]


def test_jsonl_that_is_not_utf8_is_refused_or_replaced_and_counted(tmp_path, capsys):
  spec = _word_tokenizer(tmp_path / 'tok')
  (tmp_path / 'in.jsonl').write_bytes(b'{"text": "w1"}\n{"text": "w2 caf\xe9 w3"}\n')
  args = ['--input', tmp_path / 'in.jsonl', '--eval_fraction', '0']
  assert _prepare(*args, '--output', tmp_path / 'out') == 2
  assert _one_line(capsys).startswith(f'error: {tmp_path}/in.jsonl at byte 31: not UTF-8')
  assert _prepare(*args, '--output', tmp_path / 'out', '--tokenizer', spec, '--errors',
                  'replace') == 0
  manifest, split = data.open_prepared(str(tmp_path / 'out'), 'train')
  assert manifest['replaced'] == 1 and split.tokens().tolist() == [3, 1, 4, 0, 0, 5, 1]


def test_the_data_reader_refuses_text_its_tokenizer_cannot_read(tmp_path):
  spec = _word_tokenizer(tmp_path / 'tok')
  (tmp_path / 'latin1.txt').write_bytes(b'w1 caf\xe9')
  with pytest.raises(ValueError, match=r'latin1.txt at byte 6: not UTF-8'):
    data.load(config.Data(path=str(tmp_path / 'latin1.txt'), tokenizer=spec), 300, 0)


def test_a_tokenizer_that_is_a_fifo_is_refused(fifo):
  with pytest.raises(ValueError, match=r'^tokenizer .*pipe.txt: a FIFO \(named pipe\), not a '):
    tokenizer.load(str(fifo))


def test_a_prompt_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
  (tmp_path / 'p.txt').write_bytes(b'ab\xff')
  with pytest.raises(ValueError, match=r'p.txt at byte 2: not UTF-8 \(invalid start byte\)'):
    tokenizer.decode_utf8((tmp_path / 'p.txt').read_bytes(), str(tmp_path / 'p.txt'))


# ------------------------------------------------- token ids against the model's vocabulary

def test_a_shard_holding_an_id_the_model_lacks_is_named(tmp_path):
  (tmp_path / 'in.jsonl').write_text('{"text": "abc"}\n{"text": "de"}\n')
  out = str(tmp_path / 'out')
  assert _prepare('--input', tmp_path / 'in.jsonl', '--output', out, '--eval_fraction', '0') == 0
  shard = os.path.join(out, 'train-00000.bin')
  tokens = np.fromfile(shard, np.uint16)
  data.check_ids(data.open_prepared(out, 'train')[1], 264, 'data.path', out)
  tokens[3] = 300  # same size: the manifest's checks pass
  tokens.tofile(shard)
  with pytest.raises(data.DamagedCorpus, match=r"^data.path='.*out': train-00000.bin holds "
                                               r'token id 300 >= model.vocab_size=264 '
                                               r'\(changed since python -m trainer.prepare '
                                               r'wrote it, or its corpus.json was\)$'):
    data.load(config.Data(path=out), 264, 0)


def test_a_manifest_whose_vocab_size_was_edited_does_not_hide_the_ids(tmp_path):
  spec = _word_tokenizer(tmp_path / 'tok')
  (tmp_path / 'in.jsonl').write_text('{"text": "w1 w280"}\n')
  out = str(tmp_path / 'out')
  assert _prepare('--input', tmp_path / 'in.jsonl', '--output', out, '--tokenizer', spec,
                  '--eval_fraction', '0') == 0
  with open(os.path.join(out, data.MANIFEST)) as f:
    manifest = json.load(f)
  manifest['tokenizer']['vocab_size'] = 257  # says it fits a 264-token model: it does not
  with open(os.path.join(out, data.MANIFEST), 'w') as f:
    json.dump(manifest, f)
  _, split = data.open_prepared(out, 'train')
  with pytest.raises(data.DamagedCorpus, match='train-00000.bin holds token id 282 >= '
                                               'model.vocab_size=264'):
    data.check_ids(split, 264, 'data.path', out)


def test_a_shard_cut_short_while_read_is_one_line(tmp_path):
  (tmp_path / 'in.jsonl').write_text('{"text": "abcdef"}\n')
  out = str(tmp_path / 'out')
  assert _prepare('--input', tmp_path / 'in.jsonl', '--output', out, '--eval_fraction', '0') == 0
  _, split = data.open_prepared(out, 'train')
  os.truncate(os.path.join(out, 'train-00000.bin'), 4)
  with pytest.raises(data.DamagedCorpus, match=r'^.*train-00000.bin ended early: 14 bytes at '
                                               r'item 0 of its 7 did not read'):
    split.tokens()


# ------------------------------------------------------------------- config values

@pytest.mark.parametrize('override, message', [
    ('model.rope_theta=0', 'model.rope_theta=0.0 must be finite and > 0'),
    ('model.rope_theta=-10000', 'model.rope_theta=-10000.0 must be finite and > 0'),
    ('model.norm_eps=-1e-6', 'model.norm_eps=-1e-06 must be finite and > 0'),
    ('model.norm_eps=nan', 'model.norm_eps=nan must be finite and > 0'),
    ('hardware.cpu_devices=0', 'hardware.cpu_devices=0 must be at least 1'),
])
def test_values_that_would_end_in_nan_or_no_device_are_refused(override, message):
  cfg = config.load(DEFAULT, [f'--config.{override}'])
  with pytest.raises(ValueError, match=f'^{message}$'):
    cfg.validate()


def test_mixture_weights_whose_sum_overflows_are_refused():
  cfg = config.load(DEFAULT, ['--config.data.path=a,b', '--config.data.weights=1e308,1e308'])
  with pytest.raises(ValueError, match=r"^data.weights='1e308,1e308' add up to more than a "
                                       r'float holds: scale them down \(only their ratios '
                                       r'matter\)$'):
    cfg.validate()


def test_a_workdir_too_long_for_the_file_system_is_one_line(tmp_path, capsys):
  long = os.path.join(str(tmp_path), *['d' * 200] * 25)  # each name fits, the path does not
  assert train.main(['--config', DEFAULT, '--workdir', long]) == 2
  assert 'bytes long, plus up to 256 for the files written below it, more than the 4096' in (
      _one_line(capsys))
  with pytest.raises(ValueError, match='a name of 300 bytes'):
    validation.check_workdir(str(tmp_path / ('x' * 300)))
  assert not os.path.exists(tmp_path / ('d' * 200))


def test_generate_refuses_a_temperature_that_is_not_a_number():
  args = generate.parse_args(['--checkpoint', 'c', '--prompt', 'p', '--temperature', 'nan'])
  with pytest.raises(ValueError, match=r'^--temperature=nan must be finite and >= 0'):
    generate.check_args(args)


# ---------------------------------------------------------- prepare's pieces and disk

def _bpe(directory):
  """A byte-level BPE tokenizer.json (GPT-2's pre-tokenizer) trained on a little text."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([_text()], trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<|endoftext|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  directory.mkdir()
  tok.save(str(directory / 'tokenizer.json'))
  return str(directory / 'tokenizer.json')


def _text(n=1500):
  rng = np.random.default_rng(0)
  words = ['alpha', 'beta', 'gamma.', 'x,', '(y)', 'h\u00e9llo', '\u2603', '12345']
  gaps = [' ', ' ', '\n', '  ', '\n\n', '.\n', '\t']
  return ''.join(words[rng.integers(8)] + gaps[rng.integers(7)] for _ in range(n))


@pytest.mark.parametrize('kind', ['bytes', 'bpe'])
def test_a_large_document_is_tokenized_in_pieces_to_the_same_tokens(tmp_path, monkeypatch, kind):
  spec = '' if kind == 'bytes' else _bpe(tmp_path / 'tok')
  tok, text = tokenizer.load(spec), _text()
  (tmp_path / 'doc.txt').write_text(text, encoding='utf-8')
  (tmp_path / 'doc.jsonl').write_text(json.dumps({'text': text}) + '\n')
  whole = tok.encode_documents([text.encode() if tok.byte_level else text])[0][0].tolist()
  monkeypatch.setattr(prepare, 'PIECE_BYTES', 333)  # ~30 pieces, cut inside characters too
  monkeypatch.setattr(prepare, 'PIECE_CHARS', 222)
  units = [{'kind': 'text', 'files': [str(tmp_path / 'doc.txt')], 'bytes': 1},
           {'kind': 'jsonl', 'file': str(tmp_path / 'doc.jsonl'), 'start': 0,
            'stop': os.path.getsize(tmp_path / 'doc.jsonl'), 'bytes': 1}]
  for i, unit in enumerate(units):
    stats = prepare.work(i, unit, str(tmp_path), spec, 'text', 0.0, 'uint16')
    tokens = np.fromfile(tmp_path / f'u-{i:05d}-train.bin', np.uint16).tolist()
    assert tokens == whole + [tok.eos_id] and stats['train']['documents'] == 1
    assert stats['train']['text_bytes'] == len(text.encode())


def test_a_cut_falls_after_a_newline_or_before_a_space_between_words():
  cut = prepare._cut  # pylint: disable=protected-access
  assert cut('abcdef\nghijkl mnop', 10) == 7
  assert cut('abcdef gh\n\nijkl', 10) == 6
  assert cut('abcdefghijklmnop', 10) == 10


def test_a_full_disk_is_one_line_and_keeps_the_work_done(tmp_path, monkeypatch, capsys):
  (tmp_path / 'in.txt').write_text('text')

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / 'out' / 'x.bin'))
  monkeypatch.setattr(prepare, 'assemble', full)
  assert _prepare('--input', tmp_path / 'in.txt', '--output', tmp_path / 'out') == 1
  progress, error = capsys.readouterr().err.strip().splitlines()
  assert progress.startswith('prepare: 1/1 pieces') and error == (
      f'error: No space left on device: {tmp_path}/out/x.bin; once that is mended, the same '
      'command finishes the work (pieces done are kept)')
  assert os.path.isfile(tmp_path / 'out' / prepare.WORK / 'u-00000.json')


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
def test_the_hint_when_jax_cannot_open_a_platform_names_an_extra_that_exists(platform):
  from trainer import runtime  # pylint: disable=import-outside-toplevel
  with open(os.path.join(ROOT, 'setup.py'), encoding='utf-8') as f:
    extras = set(re.findall(r"^\s+'([\w-]+)': \[", f.read(), re.M))
  assert {'tpu', 'cuda12', 'hf'} <= extras, extras
  hint = runtime._platform_hint(platform)  # pylint: disable=protected-access
  named = re.findall(r"\.\[(\w+)\]", hint)
  assert set(named) <= extras and 'pip install -c constraints.txt -e ' in hint, hint
  assert bool(named) == (platform != 'cpu')  # the CPU needs no extra
