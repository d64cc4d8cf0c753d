"""python -m trainer.prepare: round trip, split, no-op rerun, interruption, bad input."""

import json
import os

import numpy as np
import pytest

from tests.conftest import ROOT
from trainer import data, prepare, tokenizer, train

DEFAULT = os.path.join(ROOT, 'configs', 'default.py')


def _docs(n, seed=0):
  rng = np.random.default_rng(seed)
  return [f'doc {i}: ' + 'abcdefgh'[i % 8] * int(rng.integers(0, 400)) + ' ü' for i in range(n)]


def _inputs(root, n=120):
  """Documents as JSONL (two files), text files and, with pyarrow, Parquet; returns them."""
  docs = _docs(n)
  root.mkdir(exist_ok=True)
  for part, chunk in enumerate((docs[:50], docs[50:80])):
    with open(root / f'p{part}.jsonl', 'w', encoding='utf-8') as f:
      f.writelines(json.dumps({'id': i, 'text': t}) + '\n' for i, t in enumerate(chunk))
  for i, text in enumerate(docs[80:100]):
    (root / f't{i:02d}.txt').write_text(text, encoding='utf-8')
  pq = pytest.importorskip('pyarrow.parquet')
  import pyarrow  # pylint: disable=import-outside-toplevel
  pq.write_table(pyarrow.table({'text': docs[100:]}), root / 'p.parquet', row_group_size=7)
  return docs


def _run(*argv):
  return prepare.main([*map(str, argv), '--workers', '2'])


def _doc_tokens(stream):
  tokens = stream.tokens()
  return [bytes(tokens[a:b - 1].astype(np.uint8)).decode() for a, b in
          zip(stream.bounds[:-1], stream.bounds[1:]) if tokens[b - 1] == data.EOS_ID]


def test_round_trip_tokens_documents_and_held_out_split(tmp_path, monkeypatch, capsys):
  docs = _inputs(tmp_path / 'in')
  monkeypatch.setattr(prepare, 'UNIT_BYTES', 2000)  # several pieces of work, several shards
  assert _run('--input', tmp_path / 'in/*.jsonl', tmp_path / 'in/t*.txt',
              tmp_path / 'in/p.parquet', '--output', tmp_path / 'out',
              '--eval_fraction', '0.2', '--eval_tokens', '0', '--shard_size_mb', '0.01') == 0
  assert 'prepare: ' in capsys.readouterr().err  # progress
  manifest, train_split = data.open_prepared(str(tmp_path / 'out'), 'train')
  _, held = data.open_prepared(str(tmp_path / 'out'), 'eval')
  assert len(manifest['splits']['train']['shards']) > 1 and len(train_split.shards) > 1
  held_out = [prepare.held_out(d.encode(), 0.2) for d in docs]
  assert 0 < sum(held_out) < len(docs)
  # Every document once, whole, in input order, each followed by EOS: the index's boundaries.
  assert _doc_tokens(train_split) == [d for d, h in zip(docs, held_out) if not h]
  assert _doc_tokens(held) == [d for d, h in zip(docs, held_out) if h]
  assert train_split.num_docs + held.num_docs == len(docs) == manifest['splits']['train'][
      'documents'] + manifest['splits']['eval']['documents']
  assert not os.path.exists(tmp_path / 'out' / prepare.WORK)


@pytest.mark.parametrize('want', [5000, 10**9])
def test_a_short_held_out_split_is_topped_up_to_eval_tokens(tmp_path, monkeypatch, capsys,
                                                            want):
  """A few documents by --eval_fraction hold too few tokens: the next ones by hash join them,
  whole, until --eval_tokens (at most half the tokens, one document left to train on)."""
  docs = _inputs(tmp_path / 'in')
  monkeypatch.setattr(prepare, 'UNIT_BYTES', 3000)  # several pieces: some are done again
  assert _run('--input', tmp_path / 'in/*.jsonl', tmp_path / 'in/t*.txt', '--output',
              tmp_path / 'out', '--eval_fraction', '0.02', '--eval_tokens', want) == 0
  assert 'holding out more' in capsys.readouterr().err
  manifest, train_split = data.open_prepared(str(tmp_path / 'out'), 'train')
  _, held = data.open_prepared(str(tmp_path / 'out'), 'eval')
  docs = docs[:100]  # the JSONL and text inputs
  tokens = {d: len(d.encode()) + 1 for d in docs}  # bytes and the EOS
  by_hash = sorted(docs, key=lambda d: prepare.doc_hash(d.encode()))
  held_docs, train_docs = _doc_tokens(held), _doc_tokens(train_split)
  assert sorted(held_docs + train_docs) == sorted(docs)
  assert set(held_docs) == set(by_hash[:len(held_docs)])  # the first ones by hash
  assert set(held_docs) > {d for d in docs if prepare.held_out(d.encode(), 0.02)}
  total, kept = sum(tokens.values()), sum(tokens[d] for d in held_docs)
  half, last, after = total // 2, by_hash[len(held_docs) - 1], by_hash[len(held_docs)]
  assert kept == held.num_tokens <= half
  if kept >= min(want, half):  # the first documents to reach --eval_tokens, or half
    assert kept - tokens[last] < min(want, half)
  else:  # the next would pass half the corpus
    assert kept + tokens[after] > half
  assert manifest['source']['eval_tokens'] == want
  assert _doc_tokens(train_split) == [d for d in docs if d not in set(held_docs)]  # in order



def test_a_few_long_documents_hold_out_at_most_half_the_tokens(tmp_path):
  """Topped up to --eval_tokens from a few long documents, the held-out split stops before
  the document that would take it past half the corpus; the first by hash alone larger than
  half is held out whole, one document left to train on."""
  (tmp_path / 'in').mkdir()
  docs = [f'doc {i} ' + 'x' * size for i, size in enumerate((900, 3000, 700, 1200, 400))]
  for i, text in enumerate(docs):
    (tmp_path / 'in' / f't{i}.txt').write_text(text)
  assert _run('--input', tmp_path / 'in/*.txt', '--output', tmp_path / 'out',
              '--eval_fraction', '1e-9', '--eval_tokens', 10**6) == 0
  _, held = data.open_prepared(str(tmp_path / 'out'), 'eval')
  total = sum(len(d) + 1 for d in docs)
  by_hash = sorted(docs, key=lambda d: prepare.doc_hash(d.encode()))
  held_docs = _doc_tokens(held)
  assert set(held_docs) == set(by_hash[:len(held_docs)]) and held_docs
  assert held.num_tokens <= total // 2 or len(held_docs) == 1
  assert held.num_tokens + len(by_hash[len(held_docs)]) + 1 > total // 2

def test_rerun_is_a_no_op_and_an_interrupted_run_looks_unfinished(tmp_path, monkeypatch, capsys):
  _inputs(tmp_path / 'in')
  args = ['--input', tmp_path / 'in/*.jsonl', '--output', tmp_path / 'out']

  def interrupted(*a, **k):
    raise KeyboardInterrupt
  monkeypatch.setattr(prepare, 'assemble', interrupted)
  with pytest.raises(KeyboardInterrupt):
    _run(*args)
  assert not os.path.exists(tmp_path / 'out' / data.MANIFEST)
  with pytest.raises(ValueError, match='has no corpus.json: not a prepared corpus, or its '
                                       'preparation did not finish'):
    data.read_manifest(str(tmp_path / 'out'))
  monkeypatch.undo()
  assert _run(*args) == 0  # finishes, from the pieces already done
  files = {f: os.stat(tmp_path / 'out' / f).st_mtime_ns for f in os.listdir(tmp_path / 'out')}
  capsys.readouterr()
  assert _run(*args) == 0
  assert 'already prepared from these inputs: nothing to do' in capsys.readouterr().out
  assert files == {f: os.stat(tmp_path / 'out' / f).st_mtime_ns
                   for f in os.listdir(tmp_path / 'out')}
  assert _run('--input', tmp_path / 'in/*.txt', '--output', tmp_path / 'out') == 2
  assert 'holds a corpus prepared from other input' in capsys.readouterr().err


def _word_tokenizer(directory, size, word='doc'):
  """A word-level tokenizer.json with ``size`` tokens: [UNK] 0, [END] 1 (ending documents),
  then ``word`` 0, 1, ..."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  vocab = {'[UNK]': 0, '[END]': 1, **{w: i + 2 for i, w in enumerate(
      [f'{word}{i}' for i in range(size - 2)])}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  directory.mkdir()
  tok.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '[END]'}))
  return str(directory / 'tokenizer.json')


@pytest.mark.parametrize('make, argv, message', [
    (None, ['--input', '{tmp}/nothing*.jsonl'], "--input '{tmp}/nothing*.jsonl' matches no file"),
    ('empty', ['--input', '{tmp}/e.txt', '{tmp}/e.jsonl'], 'corpus is empty: 2 file(s), 0 bytes'),
    ('blank', ['--input', '{tmp}/b.jsonl'], 'corpus is empty: 1 file(s) hold no text'),
    ('jsonl', ['--input', '{tmp}/x.jsonl', '--text_field', 'body'],
     "--text_field='body': {tmp}/x.jsonl at byte 0 has no such field (its fields: text)"),
    ('parquet', ['--input', '{tmp}/x.parquet', '--text_field', 'body'],
     "--text_field='body': {tmp}/x.parquet has no such column (its columns: text)"),
    (None, ['--input', '{tmp}', '--tokenizer', '{tmp}/none.json'], 'tokenizer file not found'),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, make, argv,
                                                            message):
  if make == 'empty':
    (tmp_path / 'e.txt').write_text('')
    (tmp_path / 'e.jsonl').write_text('')
  elif make == 'blank':
    (tmp_path / 'b.jsonl').write_text('{"text": ""}\n{"text": null}\n')
  elif make == 'jsonl':
    (tmp_path / 'x.jsonl').write_text('{"text": "a"}\n')
  elif make == 'parquet':
    pq = pytest.importorskip('pyarrow.parquet')
    import pyarrow  # pylint: disable=import-outside-toplevel
    pq.write_table(pyarrow.table({'text': ['a']}), tmp_path / 'x.parquet')
  before = set(os.listdir(tmp_path))
  argv = [a.format(tmp=tmp_path) for a in argv]
  assert _run(*argv, '--output', tmp_path / 'out') == 2
  err = capsys.readouterr().err.strip()
  assert err == f'error: {message.format(tmp=tmp_path)}' or (
      len(err.splitlines()) == 1 and message in err), err
  assert set(os.listdir(tmp_path)) == before  # no output directory


def _train(tmp_path, *overrides):
  return train.main(['--config', DEFAULT, '--workdir', str(tmp_path / 'run'),
                     '--config.steps=1', *overrides])


def test_training_refuses_a_corpus_of_another_vocabulary_or_tokenizer(tmp_path, capsys):
  (tmp_path / 'in.jsonl').write_text(''.join(
      json.dumps({'text': f'doc{i % 7} doc{i % 5} doc3'}) + '\n' for i in range(40)))
  spec = _word_tokenizer(tmp_path / 'tok', 300)
  assert _run('--input', tmp_path / 'in.jsonl', '--output', tmp_path / 'out',
              '--tokenizer', spec) == 0
  capsys.readouterr()
  out = str(tmp_path / 'out')
  assert _train(tmp_path, f'--config.data.path={out}', f'--config.data.tokenizer={spec}') == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"error: data.path='{out}' was tokenized with '{spec}' (300 tokens) but "
                 'model.vocab_size=264: the vocabularies do not match'), err
  assert _train(tmp_path, f'--config.data.path={out}', '--config.model.vocab_size=304') == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"error: data.path='{out}' was tokenized with '{spec}', not "
                 f"data.tokenizer='': set --config.data.tokenizer={spec}"), err
  assert not (tmp_path / 'run').exists()


def test_quick_start_prepare_train_resume_evaluate(tmp_path, capsys):
  """The README's real-corpus path on a small corpus: every step's command, in process."""
  from tests.test_cli import TINY  # pylint: disable=import-outside-toplevel
  from trainer import evaluate  # pylint: disable=import-outside-toplevel
  _inputs(tmp_path / 'in', n=200)
  out, run = str(tmp_path / 'corpus'), str(tmp_path / 'run')
  assert _run('--input', tmp_path / 'in/*.jsonl', tmp_path / 'in/*.parquet', '--output', out,
              '--eval_fraction', '0.3') == 0
  argv = ['--config', DEFAULT, '--workdir', run, *TINY, f'--config.data.path={out}',
          '--config.steps=4', '--config.checkpoint.every=2', '--config.eval_every=0']
  assert train.main(argv + ['--config.stop_after=2']) == 0
  assert train.main(argv) == 0
  assert 'resuming from step 2' in capsys.readouterr().out
  with open(os.path.join(run, 'metrics.jsonl')) as f:
    last_eval = [r for r in map(json.loads, f) if 'eval_bpb' in r][-1]
  assert evaluate.main(['--checkpoint', run]) == 0
  record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert record['step'] == 4 and record['tokens'] == 2 * 8 * 32
  assert record['eval_bpb'] == pytest.approx(last_eval['eval_bpb'], rel=1e-6)
  fits = (data.open_prepared(out, 'eval')[1].num_tokens - 1) // (8 * 32)
  assert evaluate.main(['--checkpoint', run, f'--config.eval_steps={fits + 50}']) == 0
  printed = capsys.readouterr()  # more than the held-out split fills: as many as it does
  record = json.loads(printed.out.strip().splitlines()[-1])
  assert record['eval_steps'] == fits and record['tokens'] == fits * 8 * 32
  assert f'{fits} batch(es) of batch_size=8 x seq_len=32: evaluating eval_steps={fits}, ' \
         f'not {fits + 50}' in printed.err
  assert train.main([*argv, f'--config.eval_steps={fits + 1}', '--workdir',
                     str(tmp_path / 'other')]) == 2  # training names the fix
  assert capsys.readouterr().err.strip().endswith(
      f'needs {(fits + 1) * 8 * 32 + 1}: set --config.eval_steps={fits} (the most it fills)')
  assert evaluate.main(['--checkpoint', str(tmp_path / 'nowhere')]) == 2
  assert capsys.readouterr().err.strip() == (f'error: no such checkpoint path: '
                                             f'{tmp_path / "nowhere"}')


def _prepare_jsonl(tmp_path, lines, spec):
  """Prepares JSONL ``lines`` (held out: none) with ``spec``; returns (manifest, train split)."""
  (tmp_path / 'in.jsonl').write_text(''.join(line + '\n' for line in lines))
  assert _run('--input', tmp_path / 'in.jsonl', '--output', tmp_path / 'out', '--tokenizer',
              spec, '--eval_fraction', '0') == 0
  return data.open_prepared(str(tmp_path / 'out'), 'train')


def test_a_document_that_tokenizes_to_nothing_is_skipped(tmp_path):
  """Without an end-of-document token blank text has no tokens: the index has no place for it."""
  spec = _word_tokenizer(tmp_path / 'tok', 10)
  os.remove(tmp_path / 'tok' / 'tokenizer_config.json')  # '[END]' is no longer known as EOS
  manifest, split = _prepare_jsonl(tmp_path, [json.dumps({'text': t}) for t in
                                              ('doc1 doc2', '   ', 'doc3', '\t')], spec)
  assert manifest['tokenizer']['eos_id'] is None
  assert manifest['splits']['train']['documents'] == split.num_docs == 2
  assert manifest['empty_documents_skipped'] == 2
  assert split.tokens().tolist() == [3, 4, 5] and split.bounds.tolist() == [0, 2, 3]


def test_a_lone_surrogate_is_tokenized_as_its_replacement(tmp_path):
  """JSON can escape half a surrogate pair; the text tokenized is the UTF-8 that was hashed.

  With --errors=replace (by default it is refused: tests/test_inputs.py).
  """
  spec = _word_tokenizer(tmp_path / 'tok', 10)
  (tmp_path / 'in.jsonl').write_text('{"text": "doc1 \\ud83d doc2"}\n{"text": "doc3"}\n')
  assert _run('--input', tmp_path / 'in.jsonl', '--output', tmp_path / 'out', '--tokenizer',
              spec, '--eval_fraction', '0', '--errors', 'replace') == 0
  _, split = data.open_prepared(str(tmp_path / 'out'), 'train')
  assert split.tokens().tolist() == [3, 0, 4, 1, 5, 1]  # '?' is unknown: [UNK]


def test_token_ids_past_a_gap_in_the_vocabulary_are_kept(tmp_path):
  """A vocabulary's largest id, not its token count, decides the corpus dtype."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  tok = Tokenizer(models.WordLevel({'[UNK]': 0, '[END]': 1, 'near': 2, 'far': 70000},
                                   unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  (tmp_path / 'tok').mkdir()
  tok.save(str(tmp_path / 'tok' / 'tokenizer.json'))
  (tmp_path / 'tok' / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '[END]'}))
  manifest, split = _prepare_jsonl(tmp_path, ['{"text": "near far"}'], str(tmp_path / 'tok'))
  assert manifest['dtype'] == 'uint32' and manifest['tokenizer']['vocab_size'] == 70001
  assert split.tokens().tolist() == [2, 70000, 1]


def test_an_id_the_corpus_dtype_cannot_hold_is_refused(tmp_path, monkeypatch):
  """Should a tokenizer give ids past its vocab_size, casting them would wrap them silently."""
  class Lying(tokenizer.Tokenizer):
    name, vocab_size, eos_id = 'lying', 300, 1

    def encode_documents(self, texts):
      return [(np.array([70000], np.int32), np.array([len(t)], np.int32)) for t in texts]

  monkeypatch.setitem(prepare._TOKENIZER, 'lying', Lying())  # pylint: disable=protected-access
  (tmp_path / 'in.txt').write_text('text')
  unit = {'kind': 'text', 'files': [str(tmp_path / 'in.txt')], 'bytes': 4}
  with pytest.raises(ValueError, match='^tokenizer lying gave token id 70000, more than the '
                                       r'corpus dtype uint16 holds \(its vocab_size is 300\)$'):
    prepare.work(0, unit, str(tmp_path), 'lying', 'text', 0.0, 'uint16')
