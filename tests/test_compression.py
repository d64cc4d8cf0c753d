"""Reference compressors: on exactly the bytes an eval scores, in bits per byte."""

import gzip
import lzma

import numpy as np

from trainer import compression, data, pipeline


def _corpus(tokens, bounds) -> data.Data:
  s = data.Stream([np.asarray(tokens, np.int32)], bounds)
  return data.Data((s,), (1.0,), s, False, True, data.EOS_ID, 'tiny', {})


def test_held_out_bytes_are_the_byte_targets_of_the_eval_batches():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=200).astype(np.int32)
  tokens[[50, 90]] = data.EOS_ID
  corpus = _corpus(tokens, [0, 51, 91, 200])
  batch_size, seq_len, eval_steps = 2, 16, 3
  targets = np.concatenate([
      pipeline.eval_rows(corpus, i, batch_size, seq_len, np.arange(batch_size))['targets'].ravel()
      for i in range(eval_steps)])
  want = bytes(t for t in targets.tolist() if t < data.BYTE_VOCAB)
  assert compression.held_out_bytes(corpus.eval, eval_steps * batch_size * seq_len) == want
  assert len(want) == 96 - 2  # both end-of-document tokens are among the targets, unscored
  ref = compression.reference(corpus, batch_size, seq_len, eval_steps)
  assert ref == {'gzip_bpb': 8 * len(gzip.compress(want, 9, mtime=0)) / len(want),
                 'xz_bpb': 8 * len(lzma.compress(want, preset=9 | lzma.PRESET_EXTREME)) / 94}


def test_compressible_text_scores_below_eight_and_only_bytes_have_a_reference():
  text = b'def f(x):\n  return x + 1\n' * 200
  noise = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint8).tobytes()
  for key in compression.COMPRESSORS:
    assert compression.bits_per_byte(text, key) < 1 < 7.9 < compression.bits_per_byte(noise, key)
  tokens = data.Stream([np.zeros(100, np.int32)], [0, 100])
  not_bytes = data.Data((tokens,), (1.0,), tokens, False, False, None, 'ids', {})
  assert compression.reference(not_bytes, 2, 8, 1) == {}
  assert compression.describe({'eval_bpb': 2.0}) == ''
  assert compression.describe({'gzip_bpb': 1.8504}) == ' (gzip -9 1.850)'
