"""Batches from trainer/data.py's streams: shuffled, packed, mixed, prefetched, resumable.

Training batches come in one of two ways:
  * prepared corpora (``Data.shuffled``): each epoch puts a corpus's documents in
    a new order, a permutation drawn from (seed, corpus, epoch), cuts their
    concatenation into sequences of ``seq_len`` + 1 tokens (inputs and the
    targets one token on), n = (tokens - 1) div seq_len of them, and shuffles
    those (another permutation of the same draw): sequence j of a corpus's
    stream is sequence ``perm_e(j mod n)`` of epoch e = j div n. Grain's
    ``MapDataset.mix`` interleaves the corpora of a mixture by weight. The batch
    for step k holds sequences k * batch_size ... of the mixed stream: rows from
    across the epoch, read together (one ``pread`` a piece of a document in a
    row), so a long document does not fill a batch, nor the steps after it
    (python -m benchmarks.data_quality);
  * the other sources: ``batch_size`` windows at random places of the token
    stream, drawn from (seed, k) with replacement (the batches ``make train``'s
    numbers were measured with).

Either way the global batch of step k is a pure function of (data, seed, k),
so each process builds only the rows its devices hold (any row can be built
without the others), and a checkpoint moved to another number of processes
resumes on the same batches. Sequences are packed: ``segments`` numbers the
documents within a row, ``positions`` restart at each document (and at the
row's start), and attention never crosses a document boundary.

Grain defines the batches: a ``MapDataset`` of steps (with ``MapDataset.mix``
for mixtures); ``Prefetcher`` builds the next ``data.prefetch`` of them in a
background thread while the devices train. The next step (``{'next_index':
step}``, the form of Grain's iterator state) is the data position a checkpoint
stores (trainer/checkpoint.py). Held-out batches are consecutive
sequences of the held-out documents in stored order, the same at every eval.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
from typing import Any

import grain
import jax
import numpy as np

from trainer import data as data_lib

EPOCHS_CACHED = 2  # document orders kept per corpus (prefetching may straddle an epoch)


class Packer:
  """One corpus's documents cut into sequences of ``seq_len`` + 1 tokens, epoch after epoch.

  Each epoch puts the documents in a new order and cuts their concatenation into
  ``per_epoch`` sequences, which it shuffles: sequence j of the corpus's stream
  is sequence ``place(j)`` of epoch j div ``per_epoch``. Both permutations are
  drawn from (seed, corpus, epoch) and kept for ``EPOCHS_CACHED`` epochs (8 bytes
  a document and 4 a sequence).
  """

  def __init__(self, stream: data_lib.Stream, seq_len: int, seed: int | None, corpus: int = 0):
    self.stream, self.seq_len, self.seed, self.corpus = stream, seq_len, seed, corpus
    self.per_epoch = (stream.num_tokens - 1) // seq_len
    self._orders, self._lock = {}, threading.Lock()

  def order(self, epoch: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(documents in epoch order, where each starts in it); stored order without a seed."""
    return self._epoch(epoch)[:2]

  def _epoch(self, epoch: int) -> tuple:
    """order(epoch) and the epoch's order of its sequences (None: in order, unseeded)."""
    if self.seed is None:
      return None, self.stream.bounds, None
    with self._lock:
      if epoch not in self._orders:
        rng = np.random.default_rng((self.seed, self.corpus, epoch))
        perm = rng.permutation(self.stream.num_docs)
        lengths = np.diff(self.stream.bounds)[perm]
        sequences = rng.permutation(self.per_epoch).astype(
            np.int32 if self.per_epoch < 2**31 else np.int64)
        self._orders[epoch] = perm, np.concatenate([[0], np.cumsum(lengths)]), sequences
        for old in sorted(self._orders)[:-EPOCHS_CACHED]:
          del self._orders[old]
      return self._orders[epoch]

  def place(self, index: int) -> tuple[int, int]:
    """(epoch, sequence of it) that sequence ``index`` of the stream is; in order unseeded."""
    epoch, seq = divmod(index, self.per_epoch)
    sequences = self._epoch(epoch)[2]
    return epoch, seq if sequences is None else int(sequences[seq])

  def read_rows(self, indices: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequences ``indices`` of the stream into the rows of ``out`` (``seq_len`` + 1 wide);
    returns (row, offset in it) of each document beginning in them (offset 0 left out)."""
    epochs, seqs = np.divmod(indices, self.per_epoch)

    def read(epoch, rows, part):
      perm, cum, sequences = self._epoch(int(epoch))
      places = seqs[rows] if sequences is None else sequences[seqs[rows]]
      return read_windows(self.stream, (perm, cum), places.astype(np.int64) * self.seq_len,
                          part)
    return _by_group(epochs, out, read)

  def read(self, epoch: int, seq: int, n: int) -> tuple[np.ndarray, list[int]]:
    """Sequences ``seq`` ... ``seq + n - 1`` of ``epoch`` as packed (unshuffled), back to
    back (n * seq_len + 1 tokens: sequence i is [i * seq_len, (i + 1) * seq_len]), and
    where documents begin."""
    tokens = np.empty(n * self.seq_len + 1, np.int32)
    begins = read_ordered(self.stream, self.order(epoch), seq * self.seq_len, tokens)
    return tokens, begins


def read_ordered(stream: data_lib.Stream, order, start: int, tokens: np.ndarray) -> list[int]:
  """Tokens ``start`` ... of the documents concatenated in ``order`` into ``tokens``
  (1-D); returns where in ``tokens`` documents begin (0 left out). See read_windows."""
  return read_windows(stream, order, [start], tokens.reshape(1, -1))[1].tolist()


def read_windows(stream: data_lib.Stream, order, starts, out: np.ndarray):
  """Row i of ``out`` (2-D, contiguous): tokens ``starts[i]`` ... of the documents
  concatenated in ``order`` = (perm, where each starts; perm None: stored order).

  Returns (row, offset in it) of each document beginning inside a row (offset 0
  left out). All rows' pieces (a piece: the part of one document in one row) are
  found at once and read back to back in one ``Stream.gather``.
  """
  perm, cum = order
  rows, width = out.shape
  starts = np.asarray(starts, np.int64)
  first = np.searchsorted(cum, starts, 'right') - 1
  counts = np.searchsorted(cum, starts + width, 'left') - first  # documents in each row
  row = np.repeat(np.arange(rows), counts)
  doc = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts - first, counts)
  begin, start = cum[doc], starts[row]
  low, high = np.maximum(begin, start), np.minimum(cum[doc + 1], start + width)
  sources = stream.bounds[doc if perm is None else perm[doc]] + (low - begin)
  raw = out if out.dtype == stream.dtype else np.empty(out.shape, stream.dtype)
  stream.gather(sources.tolist(), (high - low).tolist(), raw.reshape(-1))
  if raw is not out:
    out[:] = raw
  inside = begin > start
  return row[inside], (begin - start)[inside]


def _by_group(keys: np.ndarray, out: np.ndarray, read) -> tuple[np.ndarray, np.ndarray]:
  """Rows of ``out`` read a group (rows of one key) at a time: ``read(key, rows, part)``
  fills ``part`` with those rows and returns (row in part, offset) as read_windows does."""
  groups = np.unique(keys)
  if len(groups) == 1:
    return read(groups[0], np.arange(len(keys)), out)
  found, offsets = [], []
  for key in groups.tolist():
    rows = np.flatnonzero(keys == key)
    part = np.empty((len(rows), out.shape[1]), out.dtype)
    got, offset = read(key, rows, part)
    out[rows] = part
    found.append(rows[got])
    offsets.append(offset)
  return np.concatenate(found), np.concatenate(offsets)


def examples(inputs: np.ndarray, targets: np.ndarray, begins: list[int]) -> dict:
  """Packed examples: ``begins`` are where documents begin in ``inputs``, flattened.

  ``segments`` count the documents of a row from 0; ``positions`` restart at
  each document and at the row's start. (Cuts are few: Python lists beat numpy's
  per-call cost on them; only the per-token arrays are numpy's.)
  """
  rows, seq_len = inputs.shape
  size = rows * seq_len
  cuts = sorted(set(range(0, size, seq_len)).union(b for b in begins if b < size))
  lengths = [b - a for a, b in zip(cuts, cuts[1:] + [size])]
  segment, ids = 0, []
  for cut in cuts:
    segment = 0 if cut % seq_len == 0 else segment + 1
    ids.append(segment)
  positions = np.repeat(np.array(cuts, np.int32), lengths)
  np.subtract(_arange(size), positions, out=positions)
  return {'inputs': inputs, 'targets': targets, 'positions': positions.reshape(rows, seq_len),
          'segments': np.repeat(np.array(ids, np.int32), lengths).reshape(rows, seq_len)}


@functools.lru_cache(maxsize=8)
def _arange(size: int) -> np.ndarray:
  out = np.arange(size, dtype=np.int32)
  out.flags.writeable = False
  return out


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
  offsets = rng.integers(0, stream.num_tokens - seq_len, size=batch_size)[rows]
  tokens = np.empty((len(rows), seq_len + 1), np.int32)
  return _examples_of(tokens, read_windows(stream, (None, stream.bounds), offsets, tokens))


def _examples_of(tokens: np.ndarray, begins: tuple[np.ndarray, np.ndarray]) -> dict:
  """Packed examples of rows of ``seq_len`` + 1 tokens, documents beginning at (row, offset)."""
  rows, offsets = begins
  seq_len = tokens.shape[1] - 1
  return examples(tokens[:, :-1], tokens[:, 1:], (rows * seq_len + offsets).tolist())


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
  """Row r: sequence ``step * batch_size + r`` of the mixed stream, each shuffled apart."""
  picks = np.array([(0, step * batch_size + r) if mixture is None else
                    mixture[step * batch_size + r] for r in rows.tolist()], np.int64)
  tokens = np.empty((len(picks), packers[0].seq_len + 1), np.int32)
  return _examples_of(tokens, _by_group(picks[:, 0], tokens, lambda corpus, sel, part: packers[
      corpus].read_rows(picks[sel, 1], part)))


class TrainBatches:
  """``batches(step)``: the global batch of ``step``, laid out as ``sharding``.

  Consecutive steps come from a ``Prefetcher`` that builds the next ones in a
  background thread; asking for another step repositions it. ``position()`` is
  ``{'next_index': step}`` after the last batch handed out (the form of Grain's
  iterator state): where a resumed run continues.
  """

  def __init__(self, dataset: grain.MapDataset, sharding, batch_size: int, prefetch: int):
    self._batches = Prefetcher(dataset, prefetch)
    self._sharding, self._batch_size = sharding, batch_size
    self._last = (None, None)

  def __call__(self, step: int) -> dict[str, jax.Array]:
    if self._last[0] == step:
      return self._last[1]
    batch = to_global(self._batches.get(step), self._sharding, self._batch_size)
    self._last = (step, batch)
    return batch

  def seek(self, position: dict) -> None:
    """Continues from ``position`` (a ``position()``, as a checkpoint stores it)."""
    self._batches.start(int(position['next_index']))

  def position(self) -> dict:
    return {'next_index': self._batches.next_index}

  def close(self) -> None:
    self._batches.close()


class Prefetcher:
  """Elements ``k, k + 1, ...`` of a ``MapDataset``, ``depth`` of them built ahead by one thread.

  Grain's own iterator (``to_iter_dataset`` with a read thread) hands each
  element through a thread pool's futures: at 4,096 tokens a batch that cost
  more than building it (benchmarks/input.py: 35 M tokens/s against 105 built
  in the caller's thread). A queue between one producer thread and the caller
  costs a few microseconds. ``depth=0``: built when asked, no thread.
  """

  def __init__(self, dataset: grain.MapDataset, depth: int):
    self._dataset, self._depth = dataset, depth
    self.next_index, self._worker = 0, None

  def get(self, index: int):
    if self._depth == 0:
      self.next_index = index + 1
      return self._dataset[index]
    if self._worker is None or index != self.next_index:
      self.start(index)
    ok, item = self._worker.queue.get()
    if not ok:  # the producer has ended: asking again starts another (which may raise again)
      self.close()
      raise item
    self.next_index = index + 1
    return item

  def start(self, index: int) -> None:
    """Builds from ``index`` on (the next ``get`` asks for it)."""
    self.close()
    self.next_index = index
    if self._depth:
      self._worker = _Producer(self._dataset, index, self._depth)

  def close(self) -> None:
    if self._worker is not None:
      self._worker.stop()
      self._worker = None


class _Producer(threading.Thread):
  """Puts ``(True, dataset[k])`` for k = start, start + 1, ... (``(False, error)`` on failure)."""

  def __init__(self, dataset, start: int, depth: int):
    super().__init__(daemon=True)
    self.queue, self._stopped = queue.Queue(depth), threading.Event()
    self._dataset, self._index = dataset, start
    self.start()

  def run(self) -> None:
    while not self._stopped.is_set():
      try:
        item = (True, self._dataset[self._index])
      except Exception as e:  # pylint: disable=broad-except  # raised in the caller's thread
        item = (False, e)
      self._index += 1
      while not self._stopped.is_set():
        try:
          self.queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if not item[0]:
        return

  def stop(self) -> None:
    self._stopped.set()
    self.join()


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
  tokens, begins = np.empty((len(rows), seq_len + 1), np.int32), []
  for i, r in enumerate(rows.tolist()):
    flat, found = packer.read(0, index * batch_size + r, 1)
    tokens[i] = flat
    begins += [i * seq_len + b for b in found]
  out = examples(tokens[:, :-1], tokens[:, 1:], begins)
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
                         sharding, cfg.batch_size, cfg.data.prefetch)
  held = [to_global(eval_rows(data, i, cfg.batch_size, cfg.seq_len, rows), sharding,
                    cfg.batch_size) for i in range(cfg.eval_steps)]
  return batches, held
