"""Sources and windows: the embedded corpus, its split, packing, determinism, per-process rows."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from parallelism import mesh as mesh_lib
from trainer import config, data, pipeline


def _cfg(path='', **kw):
  return config.Data(path=path, **kw)


def _in_memory(stream: np.ndarray, bounds=None) -> data.Data:
  bounds = [0, len(stream)] if bounds is None else bounds
  s = data.Stream([stream], bounds)
  return data.Data((s,), (1.0,), s, False, True, data.EOS_ID, 'tiny', {})


@pytest.fixture(scope='module')
def corpus():
  return data.load(_cfg(), 264, 0)


def test_default_corpus_is_the_stdlib_sorted(corpus):
  files = data.default_corpus_files()
  assert files == sorted(files) and len(files) > 50
  assert all(os.path.dirname(f) == os.path.dirname(os.__file__) for f in files)
  total = sum(os.path.getsize(f) for f in files) + len(files)  # one EOS per file
  assert corpus.train_tokens + corpus.eval.num_tokens == total
  assert corpus.byte_level and corpus.eos_id == data.EOS_ID and not corpus.shuffled


def test_held_out_is_the_last_tenth(corpus):
  total = corpus.train_tokens + corpus.eval.num_tokens
  assert corpus.eval.num_tokens == total - int(total * 0.9)
  with open(data.default_corpus_files()[-1], 'rb') as f:
    last_file = np.frombuffer(f.read(), np.uint8)
  np.testing.assert_array_equal(corpus.eval.tokens()[-len(last_file) - 1:-1], last_file)


def _batch(d, seed, step, batch_size=4, seq_len=32, rows=None):
  rows = np.arange(batch_size) if rows is None else rows
  return pipeline.train_dataset(d, seed, batch_size, seq_len, rows)[step]


def test_batches_are_a_pure_function_of_seed_and_step(corpus):
  a, b = _batch(corpus, 0, 7), _batch(corpus, 0, 7)
  c, d = _batch(corpus, 0, 8), _batch(corpus, 1, 7)
  np.testing.assert_array_equal(a['inputs'], b['inputs'])
  assert not np.array_equal(a['inputs'], c['inputs'])
  assert not np.array_equal(a['inputs'], d['inputs'])
  np.testing.assert_array_equal(a['inputs'][:, 1:], a['targets'][:, :-1])
  part = _batch(corpus, 0, 7, rows=np.array([1, 3]))
  for k in a:
    np.testing.assert_array_equal(part[k], a[k][[1, 3]])


def test_windows_are_the_batches_make_train_was_measured_with(corpus):
  """Random windows from default_rng((seed, step)), as before the pipeline moved to Grain."""
  stream = np.concatenate([np.asarray(s) for s in corpus.train[0].shards])
  starts = np.random.default_rng((0, 5)).integers(0, len(stream) - 256, size=16)
  window = stream[starts[:, None] + np.arange(257)]
  batch = _batch(corpus, 0, 5, 16, 256)
  np.testing.assert_array_equal(batch['inputs'], window[:, :-1])
  np.testing.assert_array_equal(batch['targets'], window[:, 1:])
  eos = window[:, :-1] == data.EOS_ID
  np.testing.assert_array_equal(batch['segments'], np.cumsum(eos, axis=1) - eos)
  assert all(v.dtype == np.int32 for v in batch.values())


def test_segments_and_positions_restart_at_each_document():
  stream = np.array([1, 2, data.EOS_ID, 3, 4, 5, data.EOS_ID, 6, 7], np.int32)
  out = pipeline.eval_rows(_in_memory(stream, [0, 3, 7, 9]), 0, 1, 8, np.array([0]))
  np.testing.assert_array_equal(out['segments'][0], [0, 0, 0, 1, 1, 1, 1, 2])
  np.testing.assert_array_equal(out['positions'][0], [0, 1, 2, 0, 1, 2, 3, 0])


def test_eval_batches_tile_the_held_out_split(corpus):
  a = pipeline.eval_rows(corpus, 0, 2, 16, np.arange(2))
  b = pipeline.eval_rows(corpus, 1, 2, 16, np.arange(2))
  held = corpus.eval.tokens()
  np.testing.assert_array_equal(a['inputs'].ravel(), held[:32])
  np.testing.assert_array_equal(b['inputs'].ravel(), held[32:64])


def test_token_files_and_synthetic(tmp_path):
  tokens = np.arange(1000, dtype=np.uint16) % 50
  np.save(tmp_path / 't.npy', tokens)
  tokens.tofile(tmp_path / 't.bin')
  for name in ('t.npy', 't.bin'):
    c = data.load(_cfg(str(tmp_path / name)), 64, 0)
    np.testing.assert_array_equal(np.concatenate([c.train[0].tokens(), c.eval.tokens()]),
                                  tokens)
    assert not c.byte_level and isinstance(c.train[0].shards[0], np.memmap)  # not read whole
  c = data.load(_cfg('synthetic'), 64, 0)
  assert c.train[0].tokens().max() < 64 and not c.byte_level
  with pytest.raises(ValueError, match='token id 49'):
    data.load(_cfg(str(tmp_path / 't.npy')), 40, 0)


def test_text_glob(tmp_path):
  for name, text in (('b.txt', b'world'), ('a.txt', b'hello ')):
    (tmp_path / name).write_bytes(text)
  c = data.load(_cfg(str(tmp_path / '*.txt'), eval_fraction=0.5), 264, 0)
  stream = np.concatenate([c.train[0].tokens(), c.eval.tokens()])
  assert bytes(stream[stream < 256].astype(np.uint8)) == b'hello world'


def test_local_rows_follow_the_sharding(devices):
  mesh = mesh_lib.make_mesh(dict(data=2, fsdp=1, tensor=4, expert=1, dcn_data=1,
                                 dcn_fsdp=1, dcn_tensor=1, dcn_expert=1), devices)
  s = NamedSharding(mesh, PartitionSpec('data'))
  np.testing.assert_array_equal(pipeline.local_rows(s, (8, 4)), np.arange(8))
  batch = {'x': np.arange(32).reshape(8, 4)}
  out = pipeline.to_global(batch, s, 8)['x']
  assert out.sharding == s
  np.testing.assert_array_equal(jax.device_get(out), batch['x'])


def test_the_reference_command_answers_help_and_refuses_unknown_flags(capsys):
  with pytest.raises(SystemExit) as e:
    data.main(['--help'])
  assert e.value.code == 0 and 'gzip -9' in capsys.readouterr().out
  with pytest.raises(SystemExit) as e:
    data.main(['--bogus'])
  assert e.value.code == 2 and 'unrecognized arguments: --bogus' in capsys.readouterr().err


def test_token_files_refuse_negative_ids_and_a_bin_dtype_too_narrow(tmp_path):
  padded = np.array([5, 6, 7, -100, -100], np.int32)  # loss-masking padding is not a token
  np.save(tmp_path / 'p.npy', padded)
  with pytest.raises(ValueError, match=r"^data.path='.*p.npy' has token id -100 < 0$"):
    data.load(_cfg(str(tmp_path / 'p.npy')), 64, 0)
  np.save(tmp_path / 'ok.npy', np.abs(padded) % 64)  # signed, all ids valid: loads
  assert data.load(_cfg(str(tmp_path / 'ok.npy')), 64, 0).train[0].num_tokens == 4
  wide = np.array([70000, 1, 69999, 2], np.uint32)  # as uint16, each half is < the vocab
  wide.tofile(tmp_path / 'w.bin')
  with pytest.raises(ValueError, match=r"^data.bin_dtype='uint16' holds ids < 65536 but "
                                       r'model.vocab_size=70016: its .bin holds uint32 ids'):
    data.load(_cfg(str(tmp_path / 'w.bin')), 70016, 0)
  c = data.load(_cfg(str(tmp_path / 'w.bin'), bin_dtype='uint32', eval_fraction=0.5), 70016, 0)
  np.testing.assert_array_equal(np.concatenate([c.train[0].tokens(), c.eval.tokens()]), wide)


def test_a_prepared_index_that_is_not_the_shards_boundaries_is_damage(tmp_path):
  from trainer import prepare  # pylint: disable=import-outside-toplevel
  (tmp_path / 'in.jsonl').write_text('{"text": "ab"}\n{"text": "cde"}\n{"text": "f"}\n')
  out = str(tmp_path / 'out')
  assert prepare.main(['--input', str(tmp_path / 'in.jsonl'), '--output', out,
                       '--eval_fraction', '0', '--workers', '1']) == 0
  idx = os.path.join(out, 'train-00000.idx')
  assert np.fromfile(idx, np.int64).tolist() == [0, 3, 7, 9]
  data.open_prepared(out, 'train')
  for bad in ([1, 3, 7, 9], [0, 3, 7, 8], [0, 7, 3, 9], [0, 3, 3, 9]):
    np.array(bad, np.int64).tofile(idx)  # the size the manifest says, the wrong numbers
    with pytest.raises(ValueError, match=r"^data.path='.*' is damaged: train-00000.idx is not "
                                         'document boundaries rising from 0 to 9, the tokens '
                                         'its corpus.json says$'):
      data.open_prepared(out, 'train')
