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
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from models.transformer import TransformerConfig


def matmul_params(cfg: TransformerConfig) -> int:
  """Weights a token multiplies by (active parameters for MoE layers)."""
  d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  attention = d * n * h * 2 + d * k * h * 2
  moe = cfg.moe
  moe_mlp = d * moe.num_experts + moe.top_k * 3 * d * moe.mlp_dim
  mlps = sum(moe_mlp if moe.is_moe_layer(i) else 3 * d * f for i in range(cfg.num_layers))
  return cfg.num_layers * attention + mlps + d * cfg.vocab_size


def flops_per_token(cfg: TransformerConfig, seq_len: int) -> float:
  """Training FLOPs per token; formula in the module docstring."""
  attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
  return 6 * matmul_params(cfg) + attention


def trim(workdir: str, step: int) -> None:
  """Drops records after ``step`` from ``metrics.jsonl`` (a run resumed from there)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return
  with open(path, encoding='utf-8') as f:
    lines = [line for line in f if line.strip()]
  kept = [line for line in lines if json.loads(line)['step'] <= step]
  if len(kept) < len(lines):
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
      f.writelines(kept)
    os.replace(path + '.tmp', path)


class MetricsWriter:
  """Writes ``metrics.jsonl`` and TensorBoard events; shows progress.

  On a terminal, a live progress line (step, loss, tokens/s, ETA); otherwise
  (CI, pipes) one plain line per logged step.
  """

  def __init__(self, workdir: str, total_steps: int, first_step: int = 0,
               enabled: bool = True):
    self.enabled = enabled
    self.total = total_steps
    self.live = enabled and sys.stdout.isatty()
    self._start_time, self._start_step = time.time(), first_step
    if not enabled:
      return
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', encoding='utf-8')
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self._tb = SummaryWriter(os.path.join(workdir, 'tb'))

  def write(self, step: int, record: dict[str, Any]) -> None:
    """Appends one record (``step`` plus scalars) to every sink."""
    if not self.enabled:
      return
    record = {'step': step, **{k: _plain(v) for k, v in record.items()}}
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for key, value in record.items():
      if key != 'step' and isinstance(value, (int, float)):
        self._tb.add_scalar(key, value, step)
      elif isinstance(value, list):  # e.g. moe_expert_load: one scalar per expert
        for i, v in enumerate(value):
          self._tb.add_scalar(f'{key}/{i}', v, step)
    self._tb.flush()
    self._show(step, {k: (float(v) if isinstance(v, str) else v) for k, v in record.items()})

  def _show(self, step: int, record: dict[str, Any]) -> None:
    """Prints one record (non-finite values arrive as floats, printed as nan/inf)."""
    if 'eval_loss' in record:
      bpb = f" eval_bpb {record['eval_bpb']:.3f}" if 'eval_bpb' in record else ''
      self._print(f"step {step:6d} | eval_loss {record['eval_loss']:.4f}{bpb}", final=True)
      return
    done = step - self._start_step
    elapsed = time.time() - self._start_time
    eta = elapsed / max(done, 1) * (self.total - step)
    line = (f"step {step:6d}/{self.total} | loss {record['loss']:.4f} | "
            f"{record['tokens_per_sec']:,.0f} tok/s | mfu {100 * record['mfu']:.2f}% "
            f"| eta {_clock(eta)}")
    self._print(line, final=not self.live)

  def _print(self, line: str, final: bool) -> None:
    if self.live:
      sys.stdout.write('\r\x1b[2K' + line + ('\n' if final else ''))
    else:
      sys.stdout.write(line + '\n')
    sys.stdout.flush()

  def close(self) -> None:
    if self.enabled:
      if self.live:
        sys.stdout.write('\n')
      self._jsonl.close()
      self._tb.close()


def _plain(v: Any) -> Any:
  v = v.item() if hasattr(v, 'item') else v
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  return v


def _clock(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'
