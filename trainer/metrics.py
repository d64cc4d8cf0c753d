"""Training FLOPs, MFU, and where metrics go (JSON lines, TensorBoard, console).

FLOPs per trained token (forward + backward = 3x forward):

    6 * N_matmul + 6 * L * T * (num_heads * head_dim)

N_matmul counts the weights used in matmuls (attention and MLP projections and
the output layer; the embedding lookup is a gather, not a matmul, unless tied,
where the shared matrix is counted once as the output layer). An MoE layer
counts its router and the ``top_k`` experts a token uses (active parameters);
the dispatch and combine einsums and padded capacity slots are not counted. The second term
is attention: per layer and token, QK^T and AV cost 2 * T * n * h FLOPs each
over all T keys; with the causal mask each (query, key) pair is counted once,
i.e. half of that, and x3 for training gives 6 * T * n * h.

MFU = achieved FLOP/s per device / peak FLOP/s per device (see
parallelism/hardware.py for where the peak comes from).

Where the wall time goes (:class:`Stopwatch`): every record carries ``time``
(Unix seconds), ``elapsed`` (seconds since the run started) and the seconds
spent in each category since the previous record (``device_step_s``, ...); the
last record of a run adds the totals (``total_device_step_s``, ...) and
``goodput``, the fraction of the wall time spent in device steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable

import jax

from models.transformer import TransformerConfig
from trainer import compression


def matmul_params(cfg: TransformerConfig) -> int:
  """Weights a token multiplies by (active parameters for MoE layers)."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  attention = d * n * h * 2 + d * k * h * 2
  moe = cfg.moe
  moe_mlp = d * moe.num_experts + moe.top_k * 3 * d * moe.mlp_dim
  mlps = sum(moe_mlp if moe.is_moe_layer(i) else 3 * d * f for i in range(cfg.num_layers))
  return cfg.num_layers * attention + mlps + d * cfg.vocab_size


def flops_per_token(cfg: TransformerConfig, seq_len: int, causal: bool = True) -> float:
  """Training FLOPs per token; formula in the module docstring. ``causal=False`` counts
  every (query, key) pair, as MaxText's MFU did before its PR #1988 (twice the attention)."""
  attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
  return 6 * matmul_params(cfg) + attention * (1 if causal else 2)


# Where wall time goes; a record's ``<category>_s`` keys follow this order.
CATEGORIES = (
    'setup',        # building and placing the state, the peak, the parallelism report
    'compile',      # compiling the train step
    'data_wait',    # building and placing each step's batch (the device runs the step
                    # before meanwhile where the loop keeps one queued: trainer/loop.py)
    'device_step',  # the train step dispatched, and the wait for it (or the one before)
    'eval',         # evals (the eval step compiles at the first)
    'checkpoint',   # saving (asynchronous saves: the hand-off, and waiting for the previous)
    'other',        # writing metrics, the profiler, whatever is left
)


class Stopwatch:
  """Charges a run's wall time to :data:`CATEGORIES`, lap by lap."""

  def __init__(self):
    self.start = self._last = time.perf_counter()
    self.window, self.total = {}, {}

  def lap(self, category: str) -> float:
    """Charges the seconds since the previous lap to ``category``; returns them."""
    assert category in CATEGORIES, category
    now = time.perf_counter()
    seconds, self._last = now - self._last, now
    for sums in (self.window, self.total):
      sums[category] = sums.get(category, 0.0) + seconds
    return seconds

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def take(self) -> dict[str, float]:
    """Seconds per category since the last take (``data_wait_s``, ...)."""
    out = {f'{c}_s': round(self.window[c], 4) for c in CATEGORIES if c in self.window}
    self.window = {}
    return out

  def summary(self) -> dict[str, float]:
    """Totals per category and goodput: the fraction of the wall time in device steps."""
    return {**{f'total_{c}_s': round(self.total[c], 4) for c in CATEGORIES if c in self.total},
            'goodput': self.total.get('device_step', 0.0) / max(self.elapsed(), 1e-9)}


def device_memory() -> dict[str, float]:
  """Peak memory in use (the fullest local device) and its limit, in GiB, where the
  backend reports them (accelerators; not the CPU)."""
  try:
    stats = [d.memory_stats() for d in jax.local_devices()]
  except Exception:  # pylint: disable=broad-except  # a backend without memory statistics
    return {}
  stats = [st for st in stats if st and 'bytes_in_use' in st]
  if not stats:
    return {}
  peak = max(st.get('peak_bytes_in_use', st['bytes_in_use']) for st in stats)
  limits = [st['bytes_limit'] for st in stats if st.get('bytes_limit')]
  return {'memory_peak_gib': peak / 2**30,
          **({'memory_limit_gib': min(limits) / 2**30} if limits else {})}


OUTPUTS = ('metrics.jsonl', 'tb')  # what a run appends to, replaced by a fresh run


def begin(workdir: str, step: int) -> None:
  """Readies the outputs of a run starting at ``step``: a fresh run (0) replaces an
  earlier run's; a resumed one trims them to ``step`` (see trim)."""
  if step:
    trim(workdir, step)
    return
  old = [p for p in OUTPUTS if os.path.exists(os.path.join(workdir, p))]
  if old:
    print(f'{workdir}: replacing the outputs of an earlier run ({", ".join(old)})')
  for p in old:
    path = os.path.join(workdir, p)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def trim(workdir: str, step: int) -> None:
  """Drops records after ``step`` from ``metrics.jsonl`` (a run resumed from there).

  A last line that does not read (cut short: the write of a process killed, or of
  a full disk) is dropped with a warning; an unreadable line before it is an error
  (ValueError) naming it.
  """
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return
  records, torn = read_records(path)
  if torn is not None:
    print(f'warning: {path}: dropped its last line, cut short ({len(torn)} bytes: '
          f'{torn.strip()[:40]!r})')
  kept = [line for line, record in records if record['step'] <= step]
  if torn is None and len(kept) == len(records):
    return
  try:
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
      f.writelines(line if line.endswith('\n') else line + '\n' for line in kept)
    os.replace(path + '.tmp', path)
  finally:  # a full disk: our temporary goes, metrics.jsonl stays as it was
    if os.path.exists(path + '.tmp'):
      os.remove(path + '.tmp')


def read_records(path: str) -> tuple[list[tuple[str, dict]], str | None]:
  """([(line, record)], the last line if it does not read) of a metrics.jsonl file.

  Raises ValueError naming a line before the last that is not a record.
  """
  with open(path, encoding='utf-8', errors='replace') as f:
    lines = [line for line in f if line.strip()]
  records = []
  for i, line in enumerate(lines):
    try:
      record = json.loads(line)
      if not (isinstance(record, dict) and isinstance(record.get('step'), int)):
        raise ValueError('no step')
    except ValueError as e:
      if i == len(lines) - 1:
        return records, line
      raise ValueError(f'{path} line {i + 1} is not a metrics record ({e}): fix or delete '
                       'that line, then run the same command again') from None
    records.append((line, record))
  return records, None


class MetricsWriter:
  """Writes ``metrics.jsonl`` and TensorBoard events; shows progress.

  On a terminal, a live progress line (step, loss, tokens/s, MFU, device memory
  where reported, elapsed time, ETA); otherwise (CI, pipes) one plain line per
  logged step. Every record gets ``time``, ``elapsed`` and the seconds per
  category of ``clock`` since the previous record.
  """

  def __init__(self, workdir: str, total_steps: int, first_step: int = 0,
               enabled: bool = True, clock: Stopwatch | None = None,
               begin: Callable[[], None] | None = None):
    """``begin``: called once before the files are opened, at the first record (or
    begin()); an earlier run's outputs stay until then."""
    self.enabled = enabled
    self.total = total_steps
    self.live = enabled and sys.stdout.isatty()
    self.clock = clock or Stopwatch()
    self._start_time, self._start_step = time.time(), first_step
    self._workdir, self._begin, self.started = workdir, begin, False

  def begin(self) -> None:
    """Starts the outputs (``begin``, then the files), unless started."""
    if self.started or not self.enabled:
      return
    if self._begin:
      self._begin()
    # Here, not at the top: tensorboardX imports torch (about 2 s), which only the process
    # that writes the metrics needs, not the others, nor launch.aot's compile workers.
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self._jsonl = open(os.path.join(self._workdir, 'metrics.jsonl'), 'a', encoding='utf-8')
    self._tb = SummaryWriter(os.path.join(self._workdir, 'tb'))
    self.started = True

  def write(self, step: int, record: dict[str, Any]) -> None:
    """Appends one record (``step`` plus scalars) to every sink."""
    timing = {'time': round(time.time(), 3), 'elapsed': round(self.clock.elapsed(), 4),
              **self.clock.take()}
    if not self.enabled:
      return
    self.begin()
    record = {'step': step, **{k: _plain(v) for k, v in record.items()}, **timing}
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for key, value in record.items():
      if key not in ('step', 'time') and isinstance(value, (int, float)):
        self._tb.add_scalar(key, value, step)
      elif isinstance(value, list):  # e.g. moe_expert_load: one scalar per expert
        for i, v in enumerate(value):
          self._tb.add_scalar(f'{key}/{i}', v, step)
    self._tb.flush()
    self._show(step, {k: (float(v) if isinstance(v, str) else v) for k, v in record.items()})

  def write_summary(self, step: int) -> None:
    """The run's last record: totals per category and goodput (the rest of the time: other)."""
    self.clock.lap('other')
    self.write(step, self.clock.summary())

  def _show(self, step: int, record: dict[str, Any]) -> None:
    """Prints one record (non-finite values arrive as floats, printed as nan/inf)."""
    if 'goodput' in record:
      self._print(_summary_line(record), final=True)
    elif 'eval_loss' in record:
      bpb = f" eval_bpb {record['eval_bpb']:.3f}" if 'eval_bpb' in record else ''
      bpb += compression.describe(record)  # gzip's and xz's on the same bytes, if any
      self._print(f"step {step:6d} | eval_loss {record['eval_loss']:.4f}{bpb} "
                  f"| {record.get('eval_s', 0):.1f}s", final=True)
    else:
      done = step - self._start_step
      eta = (time.time() - self._start_time) / max(done, 1) * (self.total - step)
      self._print(f'step {step:6d}/{self.total} | {_train_line(record)} | '
                  f"{_clock(record['elapsed'])} elapsed, eta {_clock(eta)}", final=not self.live)

  def _print(self, line: str, final: bool) -> None:
    if self.live:
      sys.stdout.write('\r\x1b[2K' + line + ('\n' if final else ''))
    else:
      sys.stdout.write(line + '\n')
    sys.stdout.flush()

  def close(self) -> None:
    if self.started:
      if self.live:
        sys.stdout.write('\n')
      self._jsonl.close()
      self._tb.close()


def _train_line(record: dict[str, Any]) -> str:
  """Loss, throughput, MFU and (where the backend reports it) peak device memory."""
  line = (f"loss {record['loss']:.4f} | {record['tokens_per_sec']:,.0f} tok/s | "
          f"mfu {100 * record['mfu']:.2f}%")
  if 'memory_peak_gib' in record:
    limit = f"/{record['memory_limit_gib']:.1f}" if 'memory_limit_gib' in record else ''
    line += f" | mem {record['memory_peak_gib']:.1f}{limit} GiB"
  return line


def _summary_line(record: dict[str, Any]) -> str:
  parts = ', '.join(f'{c} {record[f"total_{c}_s"]:.1f}s' for c in CATEGORIES
                    if f'total_{c}_s' in record)
  return (f"wall time {_clock(record['elapsed'])}, {100 * record['goodput']:.1f}% of it in "
          f'device steps (goodput): {parts}')


def _plain(v: Any) -> Any:
  v = v.item() if hasattr(v, 'item') else v
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  return v


def _clock(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'
