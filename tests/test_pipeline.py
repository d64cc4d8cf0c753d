"""Batches from prepared corpora: shuffling, packing, mixtures, per-process rows, resuming."""

import collections
import json
import threading

import grain
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from parallelism import mesh as mesh_lib
from trainer import config, data, pipeline, prepare


def _corpus(root, letter, n):
  """``n`` documents of ``letter``s (and their number), prepared into ``root``."""
  rng = np.random.default_rng(ord(letter))
  docs = [f'{letter}{i}:' + letter * int(rng.integers(1, 60)) for i in range(n)]
  root.mkdir()
  (root / 'in.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  assert prepare.main(['--input', str(root / 'in.jsonl'), '--output', str(root / 'out'),
                       '--eval_fraction', '0.3', '--eval_tokens', '0', '--workers', '1']) == 0
  return str(root / 'out'), docs


@pytest.fixture(scope='module')
def corpora(tmp_path_factory):
  root = tmp_path_factory.mktemp('corpora')
  return _corpus(root / 'a', 'a', 80), _corpus(root / 'b', 'b', 40)


def _load(path, **kw):
  return data.load(config.Data(path=path, **kw), 264, 0)


def _texts(tokens):
  """The documents (EOS-separated) in a token sequence."""
  text = bytes(np.where(tokens == data.EOS_ID, ord('|'), tokens).astype(np.uint8)).decode()
  return text.split('|')


def _epoch(packer, epoch):
  flat, _ = packer.read(epoch, 0, packer.per_epoch)
  return flat


def test_documents_are_shuffled_per_seed_and_epoch_each_read_once(corpora):
  (path, docs), _ = corpora
  stream = _load(path).train[0]
  train_docs = [d for d in docs if not prepare.held_out(d.encode(), 0.3)]
  packer = pipeline.Packer(stream, 16, seed=0)
  first = _epoch(packer, 0)
  assert len(first) == packer.per_epoch * 16 + 1 > stream.num_tokens - 17
  whole = _texts(first)[:-1]  # the last one is cut at the epoch's end
  assert len(whole) == len(set(whole)) and set(whole) <= set(train_docs)
  assert len(whole) >= len(train_docs) - 2 and whole != train_docs  # all, in another order
  np.testing.assert_array_equal(first, _epoch(pipeline.Packer(stream, 16, seed=0), 0))
  assert _texts(_epoch(packer, 1))[:-1] != whole  # each epoch its own order
  assert _texts(_epoch(pipeline.Packer(stream, 16, seed=1), 0))[:-1] != whole


def test_rows_are_sequences_drawn_from_across_the_epoch(corpora):
  """An epoch's steps read each of its packed sequences once, in a shuffled order: a batch
  is not consecutive sequences (a long document would fill it, and the steps after it)."""
  (path, _), _ = corpora
  d = _load(path)
  packer = pipeline.Packer(d.train[0], 16, seed=0)
  n = packer.per_epoch
  dataset = pipeline.train_dataset(d, 0, 4, 16, np.arange(4))
  batches = [dataset[k] for k in range(2 * n // 4 + 1)]
  rows = np.concatenate([b['inputs'] for b in batches])
  targets = np.concatenate([b['targets'] for b in batches])
  packed = [_epoch(packer, e) for e in (0, 1)]
  places = [packer.place(i) for i in range(2 * n)]
  for i, (epoch, seq) in enumerate(places):  # row i: the packed sequence place(i) says
    assert epoch == i // n
    np.testing.assert_array_equal(rows[i], packed[epoch][seq * 16:seq * 16 + 16])
    np.testing.assert_array_equal(targets[i], packed[epoch][seq * 16 + 1:seq * 16 + 17])
  order = [[seq for _, seq in places[e * n:(e + 1) * n]] for e in (0, 1)]
  assert sorted(order[0]) == sorted(order[1]) == list(range(n))  # each sequence once an epoch
  assert order[0] != order[1]  # each epoch its own order
  old = packed[0][:4 * 16].reshape(4, 16)  # the old reader's first batch: sequences 0-3
  assert not np.array_equal(rows[:4], old)
  steps = np.reshape(order[0][:n - n % 4], (-1, 4))
  assert (np.diff(steps, axis=1) == 1).mean() < 0.2  # the old reader's: 1.0
  assert np.mean(np.ptp(steps, axis=1)) > n / 4  # a batch's rows spread over the epoch
  again = pipeline.train_dataset(d, 0, 4, 16, np.arange(4))[3]['inputs']
  np.testing.assert_array_equal(again, rows[12:16])  # a pure function of (seed, step)
  other = pipeline.train_dataset(d, 1, 4, 16, np.arange(4))[3]['inputs']
  assert not np.array_equal(other, rows[12:16])


def test_packing_marks_every_document(corpora):
  (path, _), _ = corpora
  batch = pipeline.train_dataset(_load(path), 0, 4, 64, np.arange(4))[3]
  for inputs, segments, positions in zip(batch['inputs'], batch['segments'],
                                         batch['positions']):
    after_eos = np.concatenate([[False], inputs[:-1] == data.EOS_ID])
    np.testing.assert_array_equal(segments, np.cumsum(after_eos))
    starts = np.where(after_eos | (np.arange(64) == 0), np.arange(64), 0)
    np.testing.assert_array_equal(positions, np.arange(64) - np.maximum.accumulate(starts))
    assert segments[-1] > 0  # documents are shorter than a row


def _source(row):
  return 'a' if ord('a') in row else 'b'


def test_a_mixture_follows_its_weights(corpora):
  (a, _), (b, _) = corpora
  mixed = _load(f'{a},{b}', weights='3,1', eval_path=a)
  assert mixed.weights == (0.75, 0.25) and mixed.shuffled
  dataset = pipeline.train_dataset(mixed, 0, 8, 16, np.arange(8))
  rows = [_source(r) for k in range(40) for r in dataset[k]['inputs']]
  assert collections.Counter(rows) == {'a': 240, 'b': 80}
  by_size = _load(f'{a},{b}', eval_path=a)  # '': weighted by training tokens
  sizes = [s.num_tokens for s in by_size.train]
  assert by_size.weights == pytest.approx([x / sum(sizes) for x in sizes])
  with pytest.raises(ValueError, match="data.eval_path='' but data.path is a mixture of 2"):
    _load(f'{a},{b}')
  with pytest.raises(ValueError, match=r"data.weights='3' is not 2 positive number\(s\)"):
    _load(f'{a},{b}', weights='3', eval_path=a)


@pytest.mark.parametrize('mixture', [False, True])
def test_each_process_builds_only_its_rows(corpora, mixture):
  (a, _), (b, _) = corpora
  d = _load(f'{a},{b}', eval_path=b) if mixture else _load(a)
  full = pipeline.train_dataset(d, 0, 8, 16, np.arange(8))
  halves = [pipeline.train_dataset(d, 0, 8, 16, np.arange(8)[p::2]) for p in (0, 1)]
  for step in (0, 5, 31):
    for p, half in enumerate(halves):
      for k, v in half[step].items():
        np.testing.assert_array_equal(v, full[step][k][p::2])


def test_resume_on_another_process_count_repeats_and_skips_nothing(corpora, devices):
  """Two processes (each half of the rows) stop after step 3; one process resumes."""
  (a, _), (b, _) = corpora
  d = _load(f'{a},{b}', eval_path=a)
  read = lambda rows: pipeline.Prefetcher(pipeline.train_dataset(d, 0, 8, 16, rows), 2)
  straight = read(np.arange(8))
  expected = [straight.get(step)['inputs'] for step in range(6)]
  processes = [read(np.arange(4)), read(np.arange(4, 8))]
  for step in range(3):
    got = np.concatenate([p.get(step)['inputs'] for p in processes])
    np.testing.assert_array_equal(got, expected[step])
  position = {'next_index': processes[0].next_index}
  assert position == {'next_index': processes[1].next_index} == {'next_index': 3}
  for p in (straight, *processes):
    p.close()
  mesh = mesh_lib.make_mesh(dict(data=8, fsdp=1, tensor=1, expert=1, dcn_data=1, dcn_fsdp=1,
                                 dcn_tensor=1, dcn_expert=1), devices)
  sharding = NamedSharding(mesh, PartitionSpec('data'))
  resumed = pipeline.TrainBatches(pipeline.train_dataset(d, 0, 8, 16, np.arange(8)), sharding,
                                  8, 2)
  resumed.seek(position)
  for step in range(3, 6):
    np.testing.assert_array_equal(np.asarray(resumed(step)['inputs']), expected[step])
  assert resumed.position() == {'next_index': 6}
  resumed.close()


def test_eval_path_scores_another_corpus_held_out_documents(corpora):
  (a, docs_a), (b, _) = corpora
  d = _load('', eval_path=b)  # the embedded corpus trains, b's held-out documents score
  assert not d.shuffled and d.eval.num_tokens == data.read_manifest(b)['splits']['eval'][
      'tokens']
  held = [t for t in _texts(d.eval.tokens())[:-1]]
  assert held and all(t.startswith('b') for t in held)
  own = _load(a).eval.tokens()
  assert _texts(own)[:-1] == [t for t in docs_a if prepare.held_out(t.encode(), 0.3)]
  with pytest.raises(ValueError, match='is not a directory|does not exist'):
    _load('', eval_path=a + '/nowhere')


def test_prefetcher_repositions_and_raises_in_the_callers_thread():
  dataset = grain.MapDataset.range(100).map(lambda k: 1 // (k - 7) if k == 7 else k * k)
  ahead = pipeline.Prefetcher(dataset, 3)
  assert [ahead.get(k) for k in (0, 1, 2)] == [0, 1, 4]
  assert ahead.get(5) == 25 and ahead.next_index == 6  # another step: built from there
  assert ahead.get(6) == 36
  with pytest.raises(ZeroDivisionError):
    ahead.get(7)
  ahead.start(20)
  assert ahead.get(20) == 400
  ahead.close()
  assert pipeline.Prefetcher(dataset, 0).get(9) == 81  # depth 0: built when asked


def test_prefetcher_retries_a_step_whose_build_failed():
  """The producer ends at an error; asking for the step again must not wait on it forever."""
  failures = [1]

  def build(k):
    if k == 2 and failures:
      failures.pop()
      raise OSError('transient read error')
    return k

  ahead = pipeline.Prefetcher(grain.MapDataset.range(10).map(build), 2)
  assert ahead.get(0) == 0 and ahead.get(1) == 1
  with pytest.raises(OSError, match='transient'):
    ahead.get(2)
  got = []
  retry = threading.Thread(target=lambda: got.append(ahead.get(2)), daemon=True)
  retry.start()
  retry.join(timeout=10)
  assert got == [2], 'the retry waited on the stopped producer'
  assert ahead.get(3) == 3 and ahead.next_index == 4
  ahead.close()


def test_a_byte_level_token_file_reports_bits_per_byte(tmp_path, capsys):
  """A raw .bin of bytes and EOS (say, a byte-level prepared shard) is byte-level text."""
  from tests.test_cli import DEFAULT, TINY  # pylint: disable=import-outside-toplevel
  from trainer import train  # pylint: disable=import-outside-toplevel
  text = b''.join(open(f, 'rb').read() for f in data.default_corpus_files()[:8])
  tokens = np.frombuffer(text, np.uint8).astype(np.uint16)
  tokens[::5000] = data.EOS_ID
  tokens.tofile(tmp_path / 'bytes.bin')
  c = data.load(config.Data(path=str(tmp_path / 'bytes.bin')), 264, 0)
  assert c.byte_level and c.eos_id == data.EOS_ID and 'byte-level' in c.description
  np.array([5, 300, 7], np.uint16).tofile(tmp_path / 'wide.bin')  # an id past the bytes' 257
  assert not data.load(config.Data(path=str(tmp_path / 'wide.bin')), 512, 0).byte_level
  run = tmp_path / 'run'
  assert train.main(['--config', DEFAULT, '--workdir', str(run), *TINY, '--config.steps=1',
                     f'--config.data.path={tmp_path / "bytes.bin"}', '--config.eval_every=0',
                     '--config.checkpoint.every=0']) == 0
  with open(run / 'metrics.jsonl') as f:
    last = [r for r in map(json.loads, f) if 'eval_loss' in r][-1]
  assert last['eval_bpb'] == pytest.approx(last['eval_loss'] / np.log(2), rel=0.05)
