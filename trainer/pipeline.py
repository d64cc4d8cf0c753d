"""Batches from trainer/data.py's streams: shuffled, packed, mixed, prefetched, resumable.

Training batches come in one of two ways:
  * prepared corpora (``Data.shuffled``): each epoch puts a corpus's documents in
    a new order, a permutation drawn from (seed, corpus, epoch), and cuts their
    concatenation into sequences of ``seq_len`` + 1 tokens (inputs and the
    targets one token on); sequence j of a corpus's stream is sequence
    j mod n of epoch j div n, n = (tokens - 1) div seq_len. Grain's
    ``MapDataset.mix`` interleaves the corpora of a mixture by weight. The
    batch for step k holds sequences k * batch_size ... of the mixed stream;
  * the other sources: ``batch_size`` windows at random places of the token
    stream, drawn from (seed, k) with replacement (the batches ``make train``'s
    numbers were measured with).

Either way the global batch of step k is a pure function of (data, seed, k),
so each process builds only the rows its devices hold (any row can be built
without the others), and a checkpoint moved to another number of processes
resumes on the same batches. Sequences are packed: ``segments`` numbers the
documents within a row, ``positions`` restart at each document (and at the
row's start), and attention never crosses a document boundary.

Grain runs the loop: a ``MapDataset`` of steps whose ``to_iter_dataset``
iterator builds the next ``data.prefetch`` batches in background threads while
the devices train. Its state (``{'next_index': step}``) is the data position a
checkpoint stores (trainer/checkpoint.py). Held-out batches are consecutive
sequences of the held-out documents in stored order, the same at every eval.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import grain
import jax
import numpy as np

from trainer import data as data_lib

EPOCHS_CACHED = 2  # document orders kept per corpus (prefetch threads may straddle an epoch)


class Packer:
  """One corpus's documents cut into sequences of ``seq_len`` + 1 tokens, epoch after epoch."""

  def __init__(self, stream: data_lib.Stream, seq_len: int, seed: int | None, corpus: int = 0):
    self.stream, self.seq_len, self.seed, self.corpus = stream, seq_len, seed, corpus
    self.per_epoch = (stream.num_tokens - 1) // seq_len
    self._orders, self._lock = {}, threading.Lock()

  def order(self, epoch: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(documents in epoch order, where each starts in it); stored order without a seed."""
    if self.seed is None:
      return None, self.stream.bounds
    with self._lock:
      if epoch not in self._orders:
        rng = np.random.default_rng((self.seed, self.corpus, epoch))
        perm = rng.permutation(self.stream.num_docs)
        lengths = np.diff(self.stream.bounds)[perm]
        self._orders[epoch] = perm, np.concatenate([[0], np.cumsum(lengths)])
        for old in sorted(self._orders)[:-EPOCHS_CACHED]:
          del self._orders[old]
      return self._orders[epoch]

  def read(self, first_seq: int, tokens: np.ndarray, starts: np.ndarray) -> None:
    """Sequences ``first_seq``, ``first_seq`` + 1, ... into the rows of ``tokens``.

    ``starts`` (rows x seq_len, False on entry) gets True where a document starts.
    """
    row, count = 0, len(tokens)
    while row < count:
      epoch, seq = divmod(first_seq + row, self.per_epoch)
      n = min(count - row, self.per_epoch - seq)  # consecutive: one contiguous read
      flat = np.empty(n * self.seq_len + 1, np.int32)
      flat_starts = np.zeros(n * self.seq_len, bool)
      read_ordered(self.stream, self.order(epoch), seq * self.seq_len, flat, flat_starts)
      windows = np.lib.stride_tricks.sliding_window_view(flat, self.seq_len + 1)
      tokens[row:row + n] = windows[::self.seq_len]
      starts[row:row + n] = flat_starts.reshape(n, self.seq_len)
      row += n


def read_ordered(stream: data_lib.Stream, order, start: int, tokens: np.ndarray,
                 starts: np.ndarray) -> None:
  """Tokens ``start`` ... of the documents concatenated in ``order`` = (perm, where each starts).

  Marks in ``starts`` where documents begin (the first position excepted).
  """
  perm, cum = order
  stop = start + len(tokens)
  k = int(np.searchsorted(cum, start, 'right')) - 1
  at = start
  while at < stop:
    begin, end = int(cum[k]), min(stop, int(cum[k + 1]))
    doc = k if perm is None else int(perm[k])
    source = int(stream.bounds[doc]) + at - begin
    stream.read(source, source + end - at, tokens[at - start:end - start])
    if at == begin and 0 < at - start < len(starts):
      starts[at - start] = True
    at, k = end, k + 1


def examples(tokens: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
  """Packed examples from rows of ``seq_len`` + 1 tokens and where documents start."""
  starts[:, 0] = False
  ar = np.arange(starts.shape[1], dtype=np.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'positions': ar - np.maximum.accumulate(np.where(starts, ar, 0), axis=1),
          'segments': np.cumsum(starts, axis=1, dtype=np.int32)}


def _empty(rows: int, seq_len: int):
  return np.empty((rows, seq_len + 1), np.int32), np.zeros((rows, seq_len), bool)


# ------------------------------------------------------------------ training

def train_dataset(data: data_lib.Data, seed: int, batch_size: int, seq_len: int,
                  rows: np.ndarray) -> grain.MapDataset:
  """Element k: rows ``rows`` of the global training batch of step k."""
  if not data.shuffled:
    build = functools.partial(_window_rows, data.train[0], seed, batch_size, seq_len, rows)
  else:
    packers = [Packer(s, seq_len, seed, c) for c, s in enumerate(data.train)]
    build = functools.partial(_packed_rows, packers, _mixture(packers, data.weights),
                              batch_size, rows)
  return grain.MapDataset.range(sys.maxsize).map(build)


def _window_rows(stream, seed, batch_size, seq_len, rows, step):
  """Random windows, drawn from (seed, step) with replacement."""
  rng = np.random.default_rng((seed, step))
  offsets = rng.integers(0, stream.num_tokens - seq_len, size=batch_size)
  tokens, starts = _empty(len(rows), seq_len)
  no_order = (None, stream.bounds)
  for i, offset in enumerate(offsets[rows].tolist()):
    read_ordered(stream, no_order, offset, tokens[i], starts[i])
  return examples(tokens, starts)


def _mixture(packers: list[Packer], weights) -> grain.MapDataset | None:
  """Sequence i of the mixed stream -> (corpus, sequence in its stream); None for one corpus."""
  if len(packers) == 1:
    return None
  parts = [grain.MapDataset.range(sys.maxsize).map(functools.partial(_tag, c))
           for c in range(len(packers))]
  return grain.MapDataset.mix(parts, list(weights))


def _tag(corpus: int, index: int) -> tuple[int, int]:
  return corpus, index


def _packed_rows(packers, mixture, batch_size, rows, step):
  """Each run of rows that holds consecutive sequences of one corpus is read at once."""
  first = step * batch_size
  picks = [(0, first + r) if mixture is None else mixture[first + r] for r in rows.tolist()]
  tokens, starts = _empty(len(rows), packers[0].seq_len)
  i = 0
  while i < len(picks):
    corpus, seq = picks[i]
    n = 1
    while i + n < len(picks) and picks[i + n] == (corpus, seq + n):
      n += 1
    packers[corpus].read(seq, tokens[i:i + n], starts[i:i + n])
    i += n
  return examples(tokens, starts)


class TrainBatches:
  """``batches(step)``: the global batch of ``step``, laid out as ``sharding``.

  Consecutive steps come from Grain's prefetching iterator; asking for another
  step repositions it. ``position()`` is the iterator's state after the last
  batch handed out: where a resumed run continues.
  """

  def __init__(self, dataset: grain.MapDataset, sharding, batch_size: int, prefetch: int):
    self._dataset = dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=min(prefetch, 2), prefetch_buffer_size=prefetch))
    self._sharding, self._batch_size = sharding, batch_size
    self._iterator, self._last = None, (None, None)

  def __call__(self, step: int) -> dict[str, jax.Array]:
    if self._last[0] == step:
      return self._last[1]
    self.seek({'next_index': step})
    batch = to_global(next(self._iterator), self._sharding, self._batch_size)
    self._last = (step, batch)
    return batch

  def seek(self, position: dict) -> None:
    """Continues from ``position`` (a ``position()``, as a checkpoint stores it)."""
    if self._iterator is None:
      self._iterator = iter(self._dataset)
    if self._iterator.get_state() != position:
      self._iterator.set_state(position)

  def position(self) -> dict:
    return self._iterator.get_state()

  def close(self) -> None:
    if self._iterator is not None:
      self._iterator.close()


def identity(data: data_lib.Data, batch_size: int, seq_len: int) -> dict:
  """What defines the training batches, beyond the seed; a resume must match it.

  Shuffled corpora count their position in sequences of ``seq_len`` taken
  ``batch_size`` at a time, so those must match too.
  """
  if not data.shuffled:
    return data.identity
  return {**data.identity, 'batch_size': batch_size, 'seq_len': seq_len}


# ------------------------------------------------------------------- held-out

def eval_rows(data: data_lib.Data, index: int, batch_size: int, seq_len: int,
              rows: np.ndarray) -> dict[str, np.ndarray]:
  """Rows of held-out batch ``index``: consecutive sequences of the held-out documents.

  With a tokenizer other than bytes, ``target_bytes`` holds the UTF-8 bytes
  each target accounts for (-1: end of document).
  """
  packer = Packer(data.eval, seq_len, None)
  tokens, starts = _empty(len(rows), seq_len)
  for i, r in enumerate(rows.tolist()):
    packer.read(index * batch_size + r, tokens[i:i + 1], starts[i:i + 1])
  out = examples(tokens, starts)
  if data.eval.byte_counts is not None:
    out['target_bytes'] = np.empty((len(rows), seq_len), np.int32)
    for i, r in enumerate(rows.tolist()):
      begin = (index * batch_size + r) * seq_len + 1
      data.eval.read(begin, begin + seq_len, out['target_bytes'][i], counts=True)
  return out


# -------------------------------------------------------------- process rows

def local_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]) -> np.ndarray:
  """Indices of the batch rows this process's devices hold, in order."""
  rows = set()
  for index in sharding.addressable_devices_indices_map(global_shape).values():
    rows.update(range(*index[0].indices(global_shape[0])))
  return np.array(sorted(rows))


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding,
              global_batch: int) -> dict[str, jax.Array]:
  """Assembles per-process rows into global arrays laid out as ``sharding``."""
  return {k: jax.make_array_from_process_local_data(
              sharding, v, (global_batch,) + v.shape[1:])
          for k, v in batch.items()}


def make(data: data_lib.Data, cfg: Any, sharding) -> tuple[TrainBatches, list]:
  """(training batches, held-out batches) of a run, each process building its rows."""
  rows = local_rows(sharding, (cfg.batch_size, cfg.seq_len))
  batches = TrainBatches(train_dataset(data, cfg.seed, cfg.batch_size, cfg.seq_len, rows),
                         sharding, cfg.batch_size, cfg.data.get('prefetch', 2))
  held = [to_global(eval_rows(data, i, cfg.batch_size, cfg.seq_len, rows), sharding,
                    cfg.batch_size) for i in range(cfg.eval_steps)]
  return batches, held
