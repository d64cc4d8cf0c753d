"""Tokenizers: round trips of files trained here, byte counts, the data hook, refusals."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.transformer import Transformer, TransformerConfig
from tests.conftest import ROOT
from trainer import config, data, pipeline, step, tokenizer, train

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_tokenizer')

TEXT = ''.join(f'def f{i}(x):\n    return x * {i}  # héllo wörld ☃\n\n' for i in range(60))
UNSEEN = 'x = 1\n\n  naïve ☃ 🎉 end\tZZZ'  # characters and emoji the training text lacks


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  """A text file, a byte-level BPE tokenizer.json and a SentencePiece .model trained on it."""
  import sentencepiece  # pylint: disable=g-import-not-at-top
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('tok')
  (root / 'corpus.txt').write_text(TEXT, encoding='utf-8')
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  hf.train([str(root / 'corpus.txt')], trainers.BpeTrainer(
      vocab_size=300, special_tokens=['<|endoftext|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  (root / 'hf').mkdir()
  hf.save(str(root / 'hf' / 'tokenizer.json'))
  sentencepiece.SentencePieceTrainer.train(
      input=str(root / 'corpus.txt'), model_prefix=str(root / 'sp'), vocab_size=320,
      model_type='bpe', byte_fallback=True, character_coverage=1.0,
      normalization_rule_name='identity', remove_extra_whitespaces=False, minloglevel=2)
  return root


def _specs(files):
  return {'bytes': '', 'hf': str(files / 'hf' / 'tokenizer.json'),
          'hf_dir': str(files / 'hf'), 'sentencepiece': str(files / 'sp.model')}


@pytest.mark.parametrize('kind', ['bytes', 'hf', 'hf_dir', 'sentencepiece'])
def test_round_trip_and_byte_counts(files, kind):
  tok = tokenizer.load(_specs(files)[kind])
  expected = {'bytes': 257, 'hf': 300, 'hf_dir': 300, 'sentencepiece': 320}[kind]
  assert tok.vocab_size == expected
  assert tok.eos_id == {'bytes': 256, 'sentencepiece': 2}.get(kind, 0)  # <|endoftext|> is 0
  for text in (TEXT[:200], UNSEEN):
    (ids, counts), = tok.encode_documents([text])
    assert tok.decode(ids) == text
    assert int(counts.sum()) == len(text.encode('utf-8')) and counts.min() >= 0
    assert ids.max() < tok.vocab_size
    # trainer.prepare hands documents over as UTF-8 bytes: the same tokens as the text.
    stream, _, lengths = data.encode_documents([text.encode('utf-8')], tok)
    np.testing.assert_array_equal(stream, ids.tolist() + [tok.eos_id])
    assert lengths.tolist() == [len(ids) + 1]
  if kind != 'bytes':  # a real vocabulary: fewer tokens than bytes
    assert len(tok.encode(TEXT)) < len(TEXT.encode('utf-8')) / 2


def test_eos_from_tokenizer_config_and_a_tokenizer_without_one(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  words = Tokenizer(models.WordLevel({'[UNK]': 0, 'hello': 1, 'world': 2, '[END]': 3},
                                     unk_token='[UNK]'))
  words.pre_tokenizer = pre_tokenizers.Whitespace()
  words.save(str(tmp_path / 'tokenizer.json'))
  tok = tokenizer.load(str(tmp_path))
  assert tok.eos_id is None  # no known end-of-document token
  (ids, counts), = tok.encode_documents(['hello  wörld hello'])
  assert ids.tolist() == [1, 0, 1] and counts.sum() == len('hello  wörld hello'.encode())
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': {'content': '[END]'}}))
  assert tokenizer.load(str(tmp_path)).eos_id == 3


def _data_cfg(path, spec):
  return config.Data(path=str(path), eval_fraction=0.2, tokenizer=spec)


@pytest.mark.parametrize('kind', ['hf', 'sentencepiece'])
def test_corpus_is_tokenized_and_keeps_bits_per_byte(files, kind):
  tok = tokenizer.load(_specs(files)[kind])
  corpus = data.load(_data_cfg(files / 'corpus.txt', _specs(files)[kind]), 320, 0)
  assert not corpus.byte_level and corpus.eos_id == tok.eos_id
  assert f'tokenized with {tok.name}' in corpus.description
  held = corpus.eval.tokens()
  stream = np.concatenate([corpus.train[0].tokens(), held])
  assert stream[-1] == tok.eos_id and tok.decode(stream[:-1]) == TEXT
  eval_bytes = corpus.eval.byte_counts[0]
  assert eval_bytes.shape == held.shape and eval_bytes[-1] == -1
  # Bits per byte from the eval step: nats over text targets / their UTF-8 bytes.
  cfg = TransformerConfig(vocab_size=320, d_model=16, num_layers=1, num_heads=2,
                          num_kv_heads=2, head_dim=8, mlp_dim=32, max_seq_len=64)
  graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
  batch = pipeline.eval_rows(corpus, 0, 2, 16, np.arange(2))
  assert batch['target_bytes'].shape == (2, 16)
  sums = jax.jit(step.make_eval_step(graphdef, None))(
      params, {k: jnp.asarray(v) for k, v in batch.items()})
  targets = np.concatenate([held[1:17], held[17:33]])
  expected_bytes = len(tok.decode(targets[targets != tok.eos_id]).encode('utf-8'))
  assert abs(float(sums['bytes']) - expected_bytes) <= 2  # window edges may split a char
  assert float(sums['byte_nats']) <= float(sums['nats'])


def test_byte_level_eval_batches_are_unchanged(files):
  corpus = data.load(_data_cfg(files / 'corpus.txt', ''), 264, 0)
  assert corpus.byte_level and corpus.eval.byte_counts is None
  assert set(pipeline.eval_rows(corpus, 0, 2, 16, np.arange(2))) == {
      'inputs', 'targets', 'positions', 'segments'}


DEFAULT = os.path.join(ROOT, 'configs', 'default.py')


def _train_exit(tmp_path, capsys, *overrides):
  code = train.main(['--config', DEFAULT, '--workdir', str(tmp_path / 'run'),
                     '--config.steps=1', *overrides])
  err = capsys.readouterr().err.strip()
  assert not (tmp_path / 'run').exists()
  return code, err


def test_vocabulary_mismatch_is_one_line_exit_2(files, tmp_path, capsys):
  spec = _specs(files)['sentencepiece']
  code, err = _train_exit(tmp_path, capsys, f'--config.data.tokenizer={spec}',
                          f'--config.data.path={files / "corpus.txt"}')
  assert code == 2 and len(err.splitlines()) == 1
  assert err == (f"error: data.tokenizer='{spec}' has 320 tokens but model.vocab_size=264: "
                 'the vocabularies do not match')
  code, err = _train_exit(tmp_path, capsys, '--config.model.vocab_size=200')
  assert code == 2 and "data.tokenizer='' (byte-level) has 257 tokens" in err


@pytest.mark.parametrize('where, message', [
    ('/no/such/tokenizer.json', 'tokenizer file not found: /no/such/tokenizer.json'),
    ('gpt2', f'tokenizer file not found: {os.path.abspath("gpt2")} (a local'),
    ('DIR', 'tokenizer: no tokenizer.json or tokenizer.model in directory'),
])
def test_missing_tokenizer_says_where_it_looked(tmp_path, capsys, where, message):
  where = str(tmp_path) if where == 'DIR' else where
  code, err = _train_exit(tmp_path, capsys, f'--config.data.tokenizer={where}')
  assert code == 2 and len(err.splitlines()) == 1 and message in err, err
