"""What a Pallas kernel costs in the step model (parallelism/step_model.py): its FLOPs and
bytes, and its time from its grid.

A kernel (a ``tpu_custom_call``) carries its Mosaic module, from which
``hlo_text.kernel_grid`` reads its grid (sizes, which axes are parallel) and the shapes of
its block matmuls. Its time on a chip:

  ``max(F / (cores x core peak x efficiency), B / HBM bandwidth) + steps / cores x step``

* ``F`` and ``B``: the FLOPs and HBM bytes the kernel declares (``pl.CostEstimate``:
  parallelism/pair_sums.py's), else for splash attention, which declares none, its matmuls
  per causal block pair (``splash_flops``) and its operands and results.
* ``cores``: on a chip of two TensorCores (v4, v5p), Mosaic splits the kernel over both
  only along a grid axis marked parallel; an axis of ``n`` gives the busier core
  ``ceil(n / 2)`` of ``n`` (``cores_used``). Without such an axis of 2 or more, one core
  does it all, at half the chip's peak.
* ``efficiency``: the step model's calibrated matmul efficiency (the Pallas matmul guide
  measured its kernel as fast as XLA's matmul; ``hardware.PALLAS_STEP_SECONDS``) times
  ``Chip.kernel_efficiency`` (1 by default: a knob for the model's variants) times what
  a block matmul's shape wastes on the MXU: its contracted and output widths padded to
  the MXU's (128, or 256 on v6e; ``tile_efficiency``).
* ``step``: ``hardware.PALLAS_STEP_SECONDS`` for each grid step the busier core runs.

Every number is modeled, as the step model's are.
"""

from __future__ import annotations

import math
import re

from parallelism.hlo_text import Instr, KernelGrid, shape_dims

# The matmuls of [t, s] size each splash attention kernel runs per query-key
# block pair it visits: forward q.k and p.v; dq recomputes q.k, then do.v and
# ds.k; dkv recomputes q.k, then do.v, p.do and ds.q.
SPLASH_MATMULS = {'fwd': 2, 'dq': 3, 'dkv': 4}


def splash_flops(ins: Instr, shapes: dict[str, str]) -> float:
  """Matmul FLOPs of a splash attention kernel (a ``tpu_custom_call``), else 0.

  Read from its name (``splash_mha_{fwd,dq,dkv}...``), the shapes of q
  ``[..., heads, t, head_dim]`` and k (its first two floating-point operands of
  rank 3 or more: the compiler drops a batch of one) and the
  kernel's block sizes (its ``xprof_metadata``). The mask is causal (the only
  one models/attention.py builds): a query block visits the key blocks up to
  its last row; document masks skip no more blocks than that.
  """
  kind = re.match(r'splash_mha_(fwd|dq|dkv)', ins.name)
  if not kind or 'tpu_custom_call' not in ins.attrs:
    return 0.0
  floats = [shapes.get(o, '') for o in ins.operands]
  q, k = [shape_dims(x) for x in floats if re.match(r'(bf16|f16|f32)\[', x)
          and len(shape_dims(x)) >= 3][:2]  # [batch (absent at 1),] heads, length, head_dim
  suffix = '' if kind.group(1) == 'fwd' else '_' + kind.group(1)
  block = lambda key: int(re.search(rf'block_{key}{suffix}\\?": (\d+)', ins.attrs).group(1))
  t, s, bq, bkv = q[-2], k[-2], block('q'), block('kv')
  visited = sum(min(-(-(i + 1) * bq // bkv), -(-s // bkv)) for i in range(-(-t // bq)))
  pairs = visited * bq * bkv
  return 2.0 * SPLASH_MATMULS[kind.group(1)] * math.prod(q[:-2]) * pairs * q[-1]


def kernel_cost(ins: Instr) -> tuple[float, float] | None:
  """(FLOPs, HBM bytes) a Pallas kernel declares (``pl.CostEstimate``, printed in its
  ``tpu_custom_call``'s backend config), or None. A kernel that reads blocks of its
  operands (``parallelism/pair_sums.py``: two blocks of rows of a whole activation, and
  half of another's columns) moves fewer bytes than its operands hold; its own estimate
  says how many (tests/test_tpu_aot.py checks ours against its shapes). The splash
  kernels declare none."""
  if 'tpu_custom_call' not in ins.attrs:
    return None
  found = re.search(r'cost_estimate\\?"\s*:\s*\{([^}]*)\}', ins.attrs)
  if not found:
    return None
  value = lambda key: float(re.search(rf'{key}\\?"\s*:\s*\\?"?([0-9.e+]+)',
                                      found.group(1)).group(1))
  return value('flops'), value('bytes_accessed')


def cores_used(grid: KernelGrid, tensorcores: int) -> float:
  """The TensorCores a kernel keeps busy, as its busier core's share of the grid: Mosaic
  splits one parallel grid axis over the chip's cores (the best-balanced, here), so an
  axis of ``n`` gives ``n / ceil(n / cores)``; 1 without a parallel axis of 2 or more."""
  return max([1.0] + [n / -(-n // tensorcores) for n, par in zip(grid.bounds, grid.parallel)
                      if par and n >= 2 and tensorcores > 1])


def tile_efficiency(grid: KernelGrid, mxu: int) -> float:
  """The fraction of the MXU a kernel's block matmuls fill, weighted by their FLOPs: a
  contracted width ``k`` and an output width ``n`` pad to multiples of the MXU's ``mxu``
  (its rows stream through; ``m`` pads nothing). 1 for a kernel with no matmul."""
  work = [(m * k * n, k / (-(-k // mxu) * mxu) * n / (-(-n // mxu) * mxu))
          for m, k, n in grid.matmuls]
  total = sum(w for w, _ in work)
  return sum(w * e for w, e in work) / total if total else 1.0


def kernel_seconds(grid: KernelGrid, flops: float, hbm_bytes: float, chip) -> tuple[
    float, float, float]:
  """(total, matmul, grid-step) seconds of one call of a kernel of ``grid`` on ``chip`` (a
  ``step_model.Chip``): the module docstring's formula; ``matmul`` is its FLOPs' time
  alone, ``grid-step`` the busier core's step overheads."""
  cores = cores_used(grid, chip.tensorcores)
  rate = (cores * chip.peak_flops / chip.tensorcores * chip.matmul_efficiency
          * chip.kernel_efficiency * tile_efficiency(grid, chip.mxu))
  matmul = flops / rate
  steps = grid.steps / cores * chip.kernel_step_seconds
  return max(matmul, hbm_bytes / chip.hbm_rate) + steps, matmul, steps
