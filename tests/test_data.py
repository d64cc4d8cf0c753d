"""Input pipeline: corpus, split, packing, determinism, per-process rows."""

import os

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from parallelism import mesh as mesh_lib
from trainer import data


def _cfg(path='', **kw):
  return ml_collections.ConfigDict({'path': path, 'bin_dtype': 'uint16', 'eval_fraction': 0.1, **kw})


@pytest.fixture(scope='module')
def corpus():
  return data.load_corpus(_cfg(), 264, 0)


def test_default_corpus_is_the_stdlib_sorted(corpus):
  files = data.default_corpus_files()
  assert files == sorted(files) and len(files) > 50
  assert all(os.path.dirname(f) == os.path.dirname(os.__file__) for f in files)
  total = sum(os.path.getsize(f) for f in files) + len(files)  # one EOS per file
  assert len(corpus.train) + len(corpus.eval) == total
  assert corpus.byte_level and corpus.eos_id == data.EOS_ID


def test_held_out_is_the_last_tenth(corpus):
  stream = np.concatenate([corpus.train, corpus.eval])
  assert len(corpus.eval) == len(stream) - int(len(stream) * 0.9)
  with open(data.default_corpus_files()[-1], 'rb') as f:
    last_file = np.frombuffer(f.read(), np.uint8)
  np.testing.assert_array_equal(corpus.eval[-len(last_file) - 1:-1], last_file)


def test_batches_are_a_pure_function_of_seed_and_step(corpus):
  rows = np.arange(4)
  a = data.train_rows(corpus, 0, 7, 4, 32, rows)
  b = data.train_rows(corpus, 0, 7, 4, 32, rows)
  c = data.train_rows(corpus, 0, 8, 4, 32, rows)
  d = data.train_rows(corpus, 1, 7, 4, 32, rows)
  np.testing.assert_array_equal(a['inputs'], b['inputs'])
  assert not np.array_equal(a['inputs'], c['inputs'])
  assert not np.array_equal(a['inputs'], d['inputs'])
  np.testing.assert_array_equal(a['inputs'][:, 1:], a['targets'][:, :-1])
  part = data.train_rows(corpus, 0, 7, 4, 32, np.array([1, 3]))
  np.testing.assert_array_equal(part['inputs'], a['inputs'][[1, 3]])


def test_segments_and_positions_restart_after_eos():
  stream = np.array([1, 2, data.EOS_ID, 3, 4, 5, data.EOS_ID, 6, 7], np.int32)
  corpus = data.Corpus(stream, stream, True, data.EOS_ID, 'tiny')
  out = data.eval_rows(corpus, 0, 1, 8, np.array([0]))
  np.testing.assert_array_equal(out['segments'][0], [0, 0, 0, 1, 1, 1, 1, 2])
  np.testing.assert_array_equal(out['positions'][0], [0, 1, 2, 0, 1, 2, 3, 0])


def test_eval_batches_tile_the_held_out_split(corpus):
  a = data.eval_rows(corpus, 0, 2, 16, np.arange(2))
  b = data.eval_rows(corpus, 1, 2, 16, np.arange(2))
  np.testing.assert_array_equal(a['inputs'].ravel(), corpus.eval[:32])
  np.testing.assert_array_equal(b['inputs'].ravel(), corpus.eval[32:64])


def test_token_files_and_synthetic(tmp_path):
  tokens = np.arange(1000, dtype=np.uint16) % 50
  np.save(tmp_path / 't.npy', tokens)
  tokens.tofile(tmp_path / 't.bin')
  for name in ('t.npy', 't.bin'):
    c = data.load_corpus(_cfg(str(tmp_path / name)), 64, 0)
    np.testing.assert_array_equal(np.concatenate([c.train, c.eval]), tokens)
    assert not c.byte_level
  c = data.load_corpus(_cfg('synthetic'), 64, 0)
  assert c.train.max() < 64 and not c.byte_level
  with pytest.raises(ValueError, match='token id 49'):
    data.load_corpus(_cfg(str(tmp_path / 't.npy')), 40, 0)


def test_text_glob(tmp_path):
  for name, text in (('b.txt', b'world'), ('a.txt', b'hello ')):
    (tmp_path / name).write_bytes(text)
  c = data.load_corpus(_cfg(str(tmp_path / '*.txt'), eval_fraction=0.5), 264, 0)
  stream = np.concatenate([c.train, c.eval])
  assert bytes(stream[stream < 256].astype(np.uint8)) == b'hello world'


def test_local_rows_follow_the_sharding(devices):
  mesh = mesh_lib.make_mesh(dict(data=2, fsdp=1, tensor=4, expert=1, dcn_data=1,
                                 dcn_fsdp=1, dcn_tensor=1, dcn_expert=1), devices)
  s = NamedSharding(mesh, PartitionSpec('data'))
  np.testing.assert_array_equal(data.local_rows(s, (8, 4)), np.arange(8))
  batch = {'x': np.arange(32).reshape(8, 4)}
  out = data.to_global(batch, s, 8)['x']
  assert out.sharding == s
  np.testing.assert_array_equal(jax.device_get(out), batch['x'])
