"""A modeled step time from a compiled, scheduled XLA program (TPU HLO text).

``compiled.cost_analysis()`` gives whole-program totals only: it counts a loop
body once, whatever its trip count, and ignores communication. This model
reads the scheduled program text (``compiled.as_text()``) instead and walks it
in schedule order, as the chip runs it. Every number it gives is modeled, not
measured.

Per instruction:

The rates and the formulas for compute, ring steps and group collectives are
parallelism/pricing.py's, which the planner's cost model (parallelism/cost_model.py) prices
with too; this model reads what each instruction computes and moves. Where the planner
prices otherwise on purpose, cost_model's docstring says ("Where the step model differs").

* **Compute** (fusions, unfused ops): ``max(F / (peak_flops x matmul_efficiency),
  B / hbm_bandwidth)`` (``pricing.compute_seconds``).
  ``F`` counts the matmul FLOPs of every dot and convolution inside:
  ``2 x output elements x contracted elements``, where a convolution's
  contracted elements are its input features times the window taps that land
  on real input (the TPU compiler writes batched matmuls as convolutions with
  padded windows; padding and dilation holes count nothing). Elementwise work
  is left out. ``B`` is the bytes read and written: operands plus output,
  except that a fusion parameter that is only sliced counts its slices, and an
  in-place dynamic-update-slice counts the update, not the whole buffer.
* **Pallas kernels** (``tpu_custom_call``) are priced from their grid, read from the
  Mosaic module each carries (parallelism/kernels.py): the FLOPs and bytes they declare
  (the splash attention kernels of models/attention.py declare none and count their
  matmuls per causal block pair), at the MXU efficiency of their block matmuls' shapes,
  on one TensorCore of a two-core chip (v4, v5p) unless a parallel grid axis of 2 or more
  lets Mosaic split them, plus a fixed cost per grid step (``Pallas grid steps``).
* **Collectives** over a group of ``G`` chips, with ``L`` links (both
  directions of the ring in every torus dimension the group spans:
  ``L = 2 x ring_links x dims``; ``2 x ring_links`` without chip coordinates)
  of ``link_bandwidth`` bytes/s each:
  all-gather ``out_bytes (G-1)/G / (L bw)``, reduce-scatter
  ``in_bytes (G-1)/G / (L bw)``, all-reduce ``2 bytes (G-1)/G / (L bw)``,
  all-to-all ``bytes (G-1)/G / (L bw)``; plus ``step_latency`` per sequential
  ring step (``ceil((n-1)/2)`` per spanned dimension of extent ``n``;
  ``pricing.ring_collective_seconds``). A collective-permute sends its buffer over one
  link: ``bytes / bw + step_latency`` (``pricing.permute_seconds``).
* **Asynchronous copies and slices** (``copy-start/done``,
  ``slice-start/done``): ``bytes / hbm_bandwidth`` for each end in HBM, on DMA
  engines: twice for a copy within HBM, once for a prefetch into or an eviction
  from another memory space (``S(n)`` in the layout; ``dma_seconds``).

Schedule: a clock ``t`` advances by every compute instruction and every
synchronous collective (which blocks: all its time is exposed). An
asynchronous ``*-start`` at ``t`` finishes at ``t + transfer``; its ``*-done``
waits until then, ``t = max(t, finish)``. A transfer is therefore hidden by
the compute scheduled between its start and done, and exposed for the rest.
Transfers that share a link take turns: every collective occupies the links it
uses (a collective-permute the link most of its pairs hop along, a group
collective both directions of every torus dimension its group spans; ``links``),
and one issued while another holds any of them starts when that one finishes
(first come, first served, within one computation). A synchronous collective
waits for the links too; its wait is exposed. Transfers on separate links run
together at full rate. A while loop costs its trip count (the condition's bound
minus the counter's initial value, or the compiler's ``known_trip_count``) times
its body; a conditional its slowest branch; a call its callee.

Asynchronous collectives come in three printed forms, all read the same way
(a transfer from start to done, hidden by the compute scheduled between):
``*-start`` / ``*-done`` pairs, ``async-start`` / ``async-done`` wrappers
around a collective computation, and the TPU's async collective fusions (a
``kCustom`` fusion with an ``AsyncCollectiveStart`` custom call, compute
fusions that carry the collective along, possibly inside nested loops, and a
fusion with ``AsyncCollectiveDone``, all matched by the collective's channel).
The compute fused with a collective counts as compute; a collective that is
neither asynchronous nor carried blocks the chip for its whole transfer.

Calibration (``python -m benchmarks.calibrate``, docs/calibration.md): the
model has two fitted constants, ``pricing.MATMUL_EFFICIENCY`` (the fraction of the
data-sheet matmul peak a chip's MXUs reach) and ``pricing.LINK_EFFICIENCY`` (the
fraction of data-sheet ICI link bandwidth a collective reaches): both are
physical ratios in (0, 1]. The rows are MaxText's measured single-slice runs on three
chips (configs/calibration/): v4 22B and 52B and v5e 16B, which run no rings, and v5p 32B
to 512B, where XLA's windowed einsum runs thousands of collective-permutes a step. Each is
compiled as its source ran it (its compiler flags, at its batch or the largest at which our
program fits a chip). Over the eight, ``--fit`` finds matmuls at 0.88 alone (links at the
data sheet's rate; worst row 4.7 points), both together at 0.90 and 0.92 (worst 4.4), and
links alone at 0.57 (worst 7.5: the rows without rings disagree). The matmul efficiency alone
is the one set: the cost model (parallelism/cost_model.py) rates rings with both constants,
and a lowered link efficiency moves its decisions (docs/paper_scale.md), while the rows
barely tell the first two fits apart. Fitted on all rows but one, the matmul efficiency is
0.88 for seven of the eight held out (0.90 for the 256B), and the held-out row's error is at
worst 5.6 points (``calibrate.leave_one_out``): the model's error on a program it was not
fitted to. The other fit is ``ALTERNATIVE``: docs/benchmarks.md shows every claim under it
too. Setting the constants from ``--fit``'s output is a choice made here by hand, not per
row.

Results: step time (``t`` at the end of the entry computation), compute time
(also split into terms: ``compute_terms``),
communication (the transfer time of all collectives), exposed communication
(time the clock waited for collectives), and per asynchronous pair the compute
scheduled between start and done. launch/aot.py turns the step time into a
modeled MFU: the model's FLOPs per step / (chips x peak x step time).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import statistics
from typing import Sequence

import numpy as np

from parallelism import hardware, pricing
from parallelism.kernels import kernel_cost, kernel_seconds, splash_flops
from parallelism.ring import ADDITIONS_SCOPE, RING_SCOPE
from parallelism.hlo_text import (Instr, Module, first_group, kernel_grid, memory_space,
                                  parse, shape_bytes, shape_dims, source_target_pairs,
                                  tuple_element)

FREE = {'parameter', 'get-tuple-element', 'tuple', 'constant', 'bitcast', 'after-all',
        'partition-id', 'replica-id', 'opt-barrier', 'add-dependency', 'domain',
        'async-update', 'send', 'send-done', 'recv', 'recv-done'}
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all',
               'collective-permute', 'collective-broadcast', 'ragged-all-to-all')
DMA = ('copy', 'slice')


# The model's two fitted constants (see the module docstring, "Calibration") are
# pricing.MATMUL_EFFICIENCY and pricing.LINK_EFFICIENCY: the cost model rates rings with them.
FITTED = ('matmul_efficiency', 'link_efficiency')  # the Chip fields they set
# The calibration rows' other fit (both constants together; the link efficiency alone fits
# them worse, 7.5 points, since the rows without rings disagree), under which every modeled
# claim is shown as well (benchmarks/report.py).
ALTERNATIVE = {'matmul_efficiency': 0.9, 'link_efficiency': 0.92}
# The model's plausible range: settings it cannot pin down from the calibration rows
# (issue 64). Every modeled claim is also shown as min / median / max over ``band_chips``
# (benchmarks/report.py): a collective-permute's fixed cost (launch and synchronization;
# no public measurement, so 2 to 10 us), the links' achieved fraction of the data sheet
# (0.66: the calibration's other fit; 1.0: this fit), and HBM's (0.85: a DMA engine's
# transfers competing with compute for it; 1.0: the data sheet), and a Pallas kernel's
# block matmuls against XLA's (1.12: the Pallas matmul guide's 0.975 of peak over the
# calibrated matmul efficiency, 0.87 when set, 0.88 now; 0.8: small blocks that fill the
# MXU worse than its table shows, no public measurement; hardware.PALLAS_STEP_SECONDS).
BAND = {'step_latency': (2e-6, 5e-6, 10e-6), 'link_efficiency': (0.66, 0.8, 1.0),
        'hbm_efficiency': (0.85, 1.0), 'kernel_efficiency': (0.8, 1.0, 1.12)}


@dataclasses.dataclass(frozen=True)
class Chip:
  """The per-chip rates the model uses."""
  name: str
  peak_flops: float      # FLOP/s
  hbm_bandwidth: float   # bytes/s
  link_bandwidth: float  # bytes/s, one link, one direction
  ring_links: int        # links per direction a ring on one torus dimension uses
  step_latency: float    # seconds per ring step
  matmul_efficiency: float = 1.0  # achieved / peak matmul rate
  link_efficiency: float = 1.0    # achieved / data-sheet link bandwidth
  hbm_efficiency: float = 1.0     # achieved / data-sheet HBM bandwidth
  # Pallas kernels (parallelism/kernels.py): the TensorCores one may split over, the MXU's
  # width, a grid step's fixed cost and its block matmuls' rate relative to XLA's
  # (matmul_efficiency; 1: as fast, hardware.PALLAS_STEP_SECONDS says why)
  tensorcores: int = 1
  mxu: int = 128
  kernel_step_seconds: float = hardware.PALLAS_STEP_SECONDS
  kernel_efficiency: float = 1.0

  @classmethod
  def from_profile(cls, name: str, calibrated: bool = True) -> 'Chip':
    """The chip of hardware profile ``name``, with the fitted constants unless told not to."""
    p = hardware.get_profile(name)
    if not p.hbm_bandwidth:
      raise ValueError(f'hardware profile {name!r} has no HBM bandwidth to model with')
    fitted = ((pricing.MATMUL_EFFICIENCY, pricing.LINK_EFFICIENCY) if calibrated
              else (1.0, 1.0))
    cores = dict(tensorcores=p.tpu.tensorcores, mxu=p.tpu.mxu) if p.tpu else {}
    return cls(name, p.peak_flops, p.hbm_bandwidth, p.link_bandwidth, p.ring_links,
               p.step_latency, *fitted, **cores)

  @property
  def matmul_rate(self) -> float:
    return self.peak_flops * self.matmul_efficiency

  @property
  def link_rate(self) -> float:
    return self.link_bandwidth * self.link_efficiency

  @property
  def hbm_rate(self) -> float:
    return self.hbm_bandwidth * self.hbm_efficiency


def band_settings() -> str:
  """``BAND`` as the reports print it: each setting with its values."""
  return '; '.join(f'{k} {" / ".join(map(str, v))}' for k, v in BAND.items())


def band_range(b: dict, spec: str) -> str:
  """A band (``{'min', 'median', 'max'}``) as ``min / median / max``, each formatted ``spec``."""
  return ' / '.join(format(b[k], spec) for k in ('min', 'median', 'max'))


def band_of(values) -> dict:
  """min / median / max of ``values`` (a modeled quantity over the model's settings)."""
  values = sorted(values)
  return {'min': values[0], 'median': statistics.median(values), 'max': values[-1]}


def band_chips(chip: Chip) -> list[tuple[dict, Chip]]:
  """``chip`` under the settings of ``BAND``: each setting's middle value, each setting
  at its ends with the others in the middle, then every setting at its slow end and
  every setting at its fast end (each distinct setting once). A ratio's band is its
  min / median / max over them, each setting applied to both programs of the ratio."""
  middle = {k: v[len(v) // 2] for k, v in BAND.items()}
  settings = [middle]
  for key, values in BAND.items():
    settings += [middle | {key: values[0]}, middle | {key: values[-1]}]
  slow = {k: (v[-1] if k == 'step_latency' else v[0]) for k, v in BAND.items()}
  fast = {k: (v[0] if k == 'step_latency' else v[-1]) for k, v in BAND.items()}
  settings += [slow, fast]
  unique = list({tuple(sorted(s.items())): s for s in settings}.values())
  return [(s, dataclasses.replace(chip, **s)) for s in unique]


# ---- FLOPs and bytes of one instruction -------------------------------------------


def _window(attrs: str, k: int) -> dict[str, list]:
  w = {'size': [1] * k, 'stride': [1] * k, 'pad': [(0, 0)] * k, 'lhs_dilate': [1] * k,
       'rhs_dilate': [1] * k}
  m = re.search(r'window=\{([^}]*)\}', attrs)
  for key, value in re.findall(r'(\w+)=([\w\-x_]+)', m.group(1) if m else ''):
    if key == 'pad':
      w['pad'] = [tuple(int(v) for v in p.split('_')) for p in value.split('x')]
    elif key in w:
      w[key] = [int(v) for v in value.split('x')]
  return w


def _taps(out: int, lhs: int, size: int, stride: int, pad_lo: int, lhs_dil: int,
          rhs_dil: int) -> int:
  """(output, window tap) pairs along one spatial dim that read real input."""
  x = np.arange(out)[:, None] * stride + np.arange(size)[None, :] * rhs_dil - pad_lo
  return int(np.sum((x >= 0) & (x <= (lhs - 1) * lhs_dil) & (x % lhs_dil == 0)))


def conv_flops(ins: Instr, shapes: dict[str, str]) -> float:
  lhs, rhs = (shape_dims(shapes[o]) for o in ins.operands[:2])
  out = shape_dims(ins.shape)
  labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', ins.attrs)
  lhs_l, rhs_l, out_l = labels.groups()
  k = sum(c.isdigit() for c in out_l)
  w = _window(ins.attrs, k)
  taps, spatial = 1, 1
  for d in range(k):
    o = out[out_l.index(str(d))]
    spatial *= o
    taps *= _taps(o, lhs[lhs_l.index(str(d))], w['size'][d], w['stride'][d], w['pad'][d][0],
                  w['lhs_dilate'][d], w['rhs_dilate'][d])
  return 2.0 * math.prod(out) / spatial * taps * rhs[rhs_l.index('i')]


def dot_flops(ins: Instr, shapes: dict[str, str]) -> float:
  lhs = shape_dims(shapes[ins.operands[0]])
  m = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}', ins.attrs)
  contracted = math.prod(lhs[int(c)] for c in m.group(1).split(',') if c) if m else 1
  return 2.0 * math.prod(shape_dims(ins.shape)) * contracted


class _Costs:
  """FLOPs and bytes of compute instructions, and collective sizes."""

  def __init__(self, module: Module):
    self.m = module
    self.shapes = {c: {i.name: i.shape for i in ins} for c, ins in module.computations.items()}
    self._flops: dict[str, float] = {}
    self._roles: dict[str, str | None] = {}
    self._user_maps: dict[str, dict[str, list[Instr]]] = {}
    # Channels of the async collective fusions: the start, its continuations
    # (possibly inside nested loops) and the done all run a collective of one channel.
    self.async_channels = {channel(self.collective_in(i)) for comp in module.computations.values()
                           for i in comp if self.async_role(i) == 'start'}

  def flops(self, comp: str) -> float:
    """Matmul FLOPs of a fused computation (nested fusions included)."""
    if comp not in self._flops:
      total = 0.0
      for ins in self.m.computations.get(comp, []):
        if ins.opcode == 'convolution':
          total += conv_flops(ins, self.shapes[comp])
        elif ins.opcode == 'dot':
          total += dot_flops(ins, self.shapes[comp])
        elif ins.opcode == 'fusion':
          total += self.flops(ins.attr('calls'))
      self._flops[comp] = total
    return self._flops[comp]

  def async_role(self, ins: Instr) -> str | None:
    """'start' or 'done' for the TPU's asynchronous collective fusions, else None.

    With ``--xla_tpu_enable_async_collective_fusion`` the compiler writes an
    async collective as a ``kCustom`` fusion holding the collective and an
    ``AsyncCollectiveStart`` custom call, then compute fusions that carry the
    collective along (continuations), then a fusion with ``AsyncCollectiveDone``;
    all of one collective share its ``channel_id``.
    """
    callee = ins.attr('calls')
    if ins.opcode != 'fusion' or not callee:
      return None
    if callee not in self._roles:
      targets = {m.group(1) for i in self.m.computations.get(callee, [])
                 if i.opcode == 'custom-call'
                 for m in [re.search(r'custom_call_target="(\w+)"', i.attrs)] if m}
      self._roles[callee] = ('start' if 'AsyncCollectiveStart' in targets else
                             'done' if 'AsyncCollectiveDone' in targets else None)
    return self._roles[callee]

  def instr_flops(self, ins: Instr, comp: str) -> float:
    if ins.opcode == 'fusion':
      return self.flops(ins.attr('calls'))
    if ins.opcode == 'convolution':
      return conv_flops(ins, self.shapes[comp])
    if ins.opcode == 'dot':
      return dot_flops(ins, self.shapes[comp])
    if ins.opcode == 'custom-call':
      declared = kernel_cost(ins)
      return declared[0] if declared else splash_flops(ins, self.shapes[comp])
    return 0.0

  def instr_bytes(self, ins: Instr, comp: str) -> float:
    shapes = self.shapes[comp]
    operand = lambda i: shape_bytes(shapes.get(ins.operands[i], '')) if i < len(
        ins.operands) else 0.0
    op = ins.opcode
    if op == 'fusion':
      return self._fusion_bytes(ins, comp)
    if op in ('dynamic-slice', 'slice', 'gather'):
      return 2 * shape_bytes(ins.shape)
    if op == 'dynamic-update-slice':
      return 2 * operand(1)
    if op in ('broadcast', 'iota'):
      return shape_bytes(ins.shape)
    if op == 'custom-call' and re.search(r'custom_call_target="\w*Bitcast"', ins.attrs):
      return 0.0  # reinterprets buffers the async slices already wrote
    if op == 'custom-call' and 'custom_call_target="AllocateBuffer"' in ins.attrs:
      return 0.0  # an allocation (lax.empty's, and the compiler's own): nothing written
    if op == 'custom-call' and kernel_cost(ins):
      return kernel_cost(ins)[1]
    return sum(operand(i) for i in range(len(ins.operands))) + shape_bytes(ins.shape)

  def _fusion_bytes(self, ins: Instr, comp: str) -> float:
    callee = ins.attr('calls')
    fused = self.m.computations.get(callee, [])
    by_name = {i.name: i for i in fused}
    params = {int(i.literal): i for i in fused if i.opcode == 'parameter'}
    users = self._users(callee)
    written, in_place = 0.0, set()
    root = next((i for i in fused if i.root), None)
    outs = [by_name[o] for o in root.operands] if root and root.opcode == 'tuple' else [root]
    for out in filter(None, outs):
      if out.opcode in ('parameter', 'custom-call') or _is_collective(out):
        continue  # passed through (aliased) or carried by a collective: not compute traffic
      target = out.operands and by_name.get(out.operands[0])
      while target is not None and target.opcode == 'bitcast':
        target = by_name.get(target.operands[0])
      if out.opcode == 'dynamic-update-slice' and target is not None and \
          target.opcode == 'parameter':
        in_place.add(target.name)
        written += shape_bytes(by_name[out.operands[1]].shape)
      else:
        written += shape_bytes(out.shape)
    read = 0.0
    for k, name in enumerate(ins.operands):
      p = params.get(k)
      if p is None:
        read += shape_bytes(self.shapes[comp].get(name, ''))
        continue
      uses = users.get(p.name, [])
      if p.name in in_place or (uses and all(
          u.opcode in ('tuple', 'custom-call') or _is_collective(u) for u in uses)):
        continue
      sliced = self._sliced_bytes(callee, p.name)
      read += shape_bytes(p.shape) if sliced is None else sliced
    return read + written

  def _users(self, comp: str) -> dict[str, list[Instr]]:
    if comp not in self._user_maps:
      users: dict[str, list[Instr]] = {}
      for i in self.m.computations.get(comp, []):
        for o in i.operands:
          users.setdefault(o, []).append(i)
      self._user_maps[comp] = users
    return self._user_maps[comp]

  def _sliced_bytes(self, comp: str, name: str) -> float | None:
    """Bytes of ``name`` (in fused computation ``comp``) that are read when every use
    only slices it, directly, through bitcasts or through nested fusions (a ring step's
    block of a weight gradient's operand); None when a use reads it whole."""
    uses = self._users(comp).get(name, [])
    if not uses:
      return None
    total = 0.0
    for u in uses:
      if u.opcode in ('dynamic-slice', 'slice', 'gather') and u.operands[0] == name and \
          u.operands.count(name) == 1:
        inner = shape_bytes(u.shape)
      elif u.opcode == 'bitcast':
        inner = self._sliced_bytes(comp, u.name)
      elif u.opcode == 'fusion' and u.operands.count(name) == 1:
        callee = u.attr('calls')
        k = u.operands.index(name)
        param = next((i for i in self.m.computations.get(callee, [])
                      if i.opcode == 'parameter' and i.literal == str(k)), None)
        inner = param and self._sliced_bytes(callee, param.name)
      else:
        inner = None
      if inner is None:
        return None
      total += inner
    return total

  def collective_in(self, ins: Instr) -> Instr | None:
    """The collective a fusion or async wrapper runs, if any."""
    if ins.opcode.removesuffix('-start') in COLLECTIVES:
      return ins
    callee = ins.attr('calls')
    if ins.opcode in ('fusion', 'async-start') and callee:
      return next((i for i in self.m.computations.get(callee, [])
                   if i.opcode.removesuffix('-start') in COLLECTIVES), None)
    return None


# ---- collectives ------------------------------------------------------------------


def _is_collective(ins: Instr) -> bool:
  return ins.opcode.removesuffix('-start') in COLLECTIVES


def channel(ins: Instr | None) -> str | None:
  m = ins is not None and re.search(r'channel_id=(\d+)', ins.attrs)
  return m.group(1) if m else None



def _span(group: Sequence[int], coords) -> list[int]:
  """Extents of the group along each torus dimension it spans."""
  if coords is None or len(group) < 2:
    return [len(group)] if len(group) > 1 else []
  points = np.array([coords[d] for d in group])
  return [len(set(points[:, k])) for k in range(points.shape[1])
          if len(set(points[:, k])) > 1]


def links(ins: Instr, num_partitions: int, coords=None) -> frozenset:
  """The links a collective's transfer occupies, as ``(torus dimension, +1 | -1)``.

  A collective-permute's pair hops along the dimensions where its coordinates differ, in
  the direction of the shorter way round; the permute occupies the link most of its pairs
  hop along (a ring over two torus dimensions, as ``fsdp`` = 8 x 16, turns the corner at
  one chip in eight: the model's chip is a typical one). A group collective uses both
  directions of every dimension its group spans. Without coordinates a permute is known by
  its pairs and a group collective by its group, so only transfers on the same pairs or
  group take turns.
  """
  if ins.opcode.removesuffix('-start') == 'collective-permute':
    pairs = source_target_pairs(ins.attrs)
    if coords is None:
      return frozenset({('pairs',) + tuple(sorted(pairs))})
    extents = _extents(coords)
    hops = collections.Counter()
    for src, dst in pairs:
      for k, (a, b) in enumerate(zip(coords[src], coords[dst])):
        way, count = _shorter_way(a, b, extents[k])
        if count:
          hops[k, way] += 1
    most = max(hops.values(), default=0)
    return frozenset(link for link, n in hops.items() if n == most)
  group = first_group(ins.attrs, num_partitions)
  if coords is None or len(group) < 2:
    return frozenset({('group',) + tuple(group)})
  points = np.array([coords[d] for d in group])
  return frozenset((k, sign) for k in range(points.shape[1])
                   if len(set(points[:, k])) > 1 for sign in (1, -1))


def _extents(coords) -> list[int]:
  """The torus's extent in each dimension, from the chips' coordinates."""
  return [int(n) for n in np.array(coords).max(axis=0) + 1]


def _shorter_way(a: int, b: int, n: int) -> tuple[int, int]:
  """(direction +1 | -1, hops) from coordinate ``a`` to ``b`` the shorter way round a
  dimension of extent ``n`` (+1 on a tie); ``(1, 0)`` where they are equal."""
  d = (b - a) % n
  return (1, d) if d <= n // 2 else (-1, n - d)


def route(pairs, coords) -> tuple[int, int]:
  """(link load, hops) of a collective-permute's ``pairs`` on the torus of ``coords``: each
  pair routed dimension by dimension, the shorter way round; the load is the most pairs
  any one directed link carries, the hops the longest pair's. The model prices a permute as
  one hop on a link of its own (``pricing.permute_seconds``): a load above 1 would make it
  that many times slower, and each hop past the first adds a hop's latency, which the band's
  fixed cost per permute bounds (``BAND['step_latency']``). ``(1, 1)`` without coordinates."""
  if coords is None:
    return 1, 1
  extents = _extents(coords)
  load, longest = collections.Counter(), 0
  for src, dst in pairs:
    at, hops = list(coords[src]), 0
    for k, n in enumerate(extents):
      way, count = _shorter_way(at[k], coords[dst][k], n)
      for _ in range(count):
        load[tuple(at), k, way] += 1
        at[k] = (at[k] + way) % n
      hops += count
    longest = max(longest, hops)
  return int(max(load.values(), default=0)), int(longest)


def collective_seconds(ins: Instr, in_bytes: float, chip: Chip, num_partitions: int,
                       coords=None) -> float:
  kind = ins.opcode.removesuffix('-start')
  out_bytes = shape_bytes(ins.shape)
  if kind == 'collective-permute':
    if ins.opcode.endswith('-start'):  # (operand, output, contexts...): one buffer moves
      out_bytes = in_bytes
    return pricing.permute_seconds(out_bytes, chip.link_rate, chip.step_latency)
  group = first_group(ins.attrs, num_partitions)
  g = len(group)
  if g < 2:
    return 0.0
  moved = {'all-gather': out_bytes if not ins.opcode.endswith('-start') else g * in_bytes,
           'reduce-scatter': in_bytes, 'all-reduce': 2 * in_bytes}.get(kind, in_bytes)
  return pricing.ring_collective_seconds(moved, _span(group, coords), chip.link_rate,
                                         chip.ring_links, chip.step_latency)


# ---- the schedule -----------------------------------------------------------------


@dataclasses.dataclass
class Timeline:
  """One computation's modeled run (seconds), from its first instruction."""
  seconds: float = 0.0
  compute: float = 0.0
  comm: float = 0.0           # transfer time of all collectives
  exposed_comm: float = 0.0   # time the clock waited for collectives
  exposed_dma: float = 0.0    # time the clock waited for async copies and slices
  flops: float = 0.0
  hbm_bytes: float = 0.0
  by_kind: dict = dataclasses.field(default_factory=dict)  # collective -> [count, seconds]
  by_term: dict = dataclasses.field(default_factory=dict)  # compute term -> seconds
  by_op: dict = dataclasses.field(default_factory=dict)  # op_name -> non-matmul seconds
  by_kernel: dict = dataclasses.field(default_factory=dict)  # op_name -> Pallas kernels' seconds
  exposed_by: dict = dataclasses.field(default_factory=dict)  # exposed_key() -> seconds

  def add(self, other: 'Timeline', times: float) -> None:
    for f in ('seconds', 'compute', 'comm', 'exposed_comm', 'exposed_dma', 'flops', 'hbm_bytes'):
      setattr(self, f, getattr(self, f) + times * getattr(other, f))
    for k, (n, s) in other.by_kind.items():
      mine = self.by_kind.setdefault(k, [0, 0.0])
      mine[0] += times * n
      mine[1] += times * s
    for k, s in other.by_term.items():
      self.by_term[k] = self.by_term.get(k, 0.0) + times * s
    for mine, theirs in ((self.by_op, other.by_op), (self.by_kernel, other.by_kernel)):
      for k, s in theirs.items():
        mine[k] = mine.get(k, 0.0) + times * s
    for k, s in other.exposed_by.items():
      self.expose(k, times * s)

  def expose(self, key: str, seconds: float) -> None:
    self.exposed_by[key] = self.exposed_by.get(key, 0.0) + seconds

  def count(self, kind: str, seconds: float) -> None:
    mine = self.by_kind.setdefault(kind, [0, 0.0])
    mine[0] += 1
    mine[1] += seconds


@dataclasses.dataclass
class Result:
  """The modeled step of a whole program."""
  step_seconds: float
  compute_seconds: float
  comm_seconds: float
  exposed_comm_seconds: float
  exposed_dma_seconds: float
  flops: float                # matmul FLOPs per chip per step, loops counted
  hbm_bytes: float
  collectives: dict           # kind -> {'count', 'seconds'} per step
  compute_terms: dict         # compute_term() -> seconds per step; they sum to compute
  non_matmul_by_op: dict      # op_name (unnamed_key() without) -> seconds per step of
                              # instructions with no matmul
  pairs: list[dict]           # asynchronous collectives: start, done, what runs between
  exposed_by: dict            # exposed_key() -> seconds per step; they sum to exposed_comm
  warnings: list[str]
  # op_name -> seconds per step of Pallas kernels (custom calls with FLOPs: splash
  # attention's, parallelism/pair_sums.py's)
  kernels_by_op: dict = dataclasses.field(default_factory=dict)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class _Model:

  def __init__(self, module: Module, chip: Chip, coords=None):
    self.m, self.chip, self.coords = module, chip, coords
    self.costs = _Costs(module)
    self.memo: dict[str, Timeline] = {}
    self.pairs: list[dict] = []
    self.warnings: list[str] = []
    self.calls: dict[str, list[tuple[str, float]]] = {}  # callee -> [(caller, times)]
    self.routes: dict[tuple, tuple[int, int]] = {}  # a permute's pairs -> route()

  def run(self, comp: str) -> Timeline:
    if comp in self.memo:
      return self.memo[comp]
    tl = Timeline()
    instrs = self.m.computations.get(comp, [])
    by_name = {i.name: i for i in instrs}
    shapes = self.costs.shapes.get(comp, {})
    pending: dict[str, dict] = {}
    busy: dict[tuple, float] = {}  # link -> when the transfer holding it finishes
    for ins in instrs:
      op = ins.opcode
      if op in FREE:
        continue
      role = self.costs.async_role(ins)
      if op.endswith('-start') or role == 'start':
        self._start(ins, comp, tl, pending, shapes, busy)
      elif op.endswith('-done') or role == 'done':
        self._done(ins, tl, pending, by_name)
      elif op in ('while', 'call', 'conditional'):
        nested = self._nested(ins, comp, tl)
        self._overlap(pending, ins.name, nested.compute, nested.flops)
      elif (coll := self.costs.collective_in(ins)) is not None:
        if channel(coll) not in self.costs.async_channels:  # synchronous: blocks the chip
          s, kind = self._collective_seconds(ins, coll, shapes)
          begin = self._take_links(coll, tl.seconds, s, busy)
          tl.exposed_comm += begin - tl.seconds + s
          tl.expose(exposed_key(kind.split(' ')[0], False, coll.op_name or ins.op_name),
                    begin - tl.seconds + s)
          tl.seconds = begin + s
          tl.comm += s
          tl.count(kind, s)
        # else a continuation of an async collective fusion: its transfer counts at the start
        if ins.opcode == 'fusion':  # compute fused with the collective is compute
          self._overlap(pending, ins.name, *self._compute(ins, comp, tl))
      else:
        self._overlap(pending, ins.name, *self._compute(ins, comp, tl))
    for p in pending.values():  # never done: wait at the end
      self.warnings.append(f'{comp}: {p["start"]} has no done')
    self.memo[comp] = tl
    return tl

  @staticmethod
  def _overlap(pending: dict, name: str, seconds: float, flops: float) -> None:
    """Compute that runs while every pending transfer is in flight."""
    for p in pending.values():
      p['compute'] += seconds
      if flops:
        p['einsums'].append(name)

  def _nested(self, ins: Instr, comp: str, tl: Timeline) -> Timeline:
    """Runs a while loop (trip count x body), a call, or a conditional's slowest branch."""
    if ins.opcode == 'while':
      trips = self.trip_count(ins, comp)
      calls = [(ins.attr('body'), trips), (ins.attr('condition'), trips + 1)]
    elif ins.opcode == 'call':
      calls = [(ins.attr('to_apply'), 1)]
    else:
      m = re.search(r'branch_computations=\{([^}]*)\}', ins.attrs)
      branches = re.findall(r'%([\w.\-]+)', m.group(1) if m else ' '.join(
          filter(None, (ins.attr('true_computation'), ins.attr('false_computation')))))
      calls = [(max(branches, key=lambda c: self.run(c).seconds), 1)] if branches else []
    nested = Timeline()
    for callee, times in calls:
      self.calls.setdefault(callee, []).append((comp, times))
      nested.add(self.run(callee), times)
    tl.add(nested, 1)
    return nested

  def _compute(self, ins: Instr, comp: str, tl: Timeline) -> tuple[float, float]:
    f = self.costs.instr_flops(ins, comp)
    b = self.costs.instr_bytes(ins, comp)
    grid = kernel_grid(ins) if ins.opcode == 'custom-call' else None
    if grid is not None:  # a Pallas kernel: priced from its grid
      c, mxu, steps = kernel_seconds(grid, f, b, self.chip)
    else:
      mxu, steps = f / self.chip.matmul_rate, 0.0
      c = pricing.compute_seconds(f, b, self.chip.matmul_rate, self.chip.hbm_rate)
    tl.seconds += c
    tl.compute += c
    tl.flops += f
    tl.hbm_bytes += b
    for term, seconds in compute_terms(ins.op_name, mxu, c, steps):
      tl.by_term[term] = tl.by_term.get(term, 0.0) + seconds
    by = tl.by_op if not f else tl.by_kernel if ins.opcode == 'custom-call' else None
    if by is not None:
      key = ins.op_name or unnamed_key(ins)
      by[key] = by.get(key, 0.0) + c
    return c, f

  def _collective_seconds(self, ins: Instr, coll: Instr, shapes,
                          asynchronous: bool = False) -> tuple[float, str]:
    """(transfer seconds, kind) of the collective ``ins`` runs (``coll``, maybe inside it)."""
    in_bytes = sum(shape_bytes(shapes.get(o, '')) for o in ins.operands)
    if coll is not ins:  # inside a fusion or async wrapper: its own operand shapes
      inner = self.costs.shapes.get(ins.attr('calls'), {})
      in_bytes = sum(shape_bytes(inner.get(o, '')) for o in coll.operands)
      if coll.opcode == 'all-reduce' and shape_bytes(ins.shape) < shape_bytes(coll.shape):
        coll = dataclasses.replace(coll, opcode='reduce-scatter')  # all-reduce, then a slice
    kind = coll.opcode.removesuffix('-start') + (' (async)' if asynchronous
                                                  else ' (fused)' if coll is not ins else '')
    return collective_seconds(coll, in_bytes, self.chip, self.m.num_partitions,
                              self.coords), kind

  def _take_links(self, coll: Instr, now: float, seconds: float, busy: dict) -> float:
    """When ``coll``'s transfer of ``seconds`` begins, issued at ``now``: once every
    link it uses is free. Holds them until it finishes."""
    used = links(coll, self.m.num_partitions, self.coords)
    begin = max([now] + [busy.get(link, 0.0) for link in used])
    for link in used:
      busy[link] = begin + seconds
    return begin

  def _start(self, ins: Instr, comp: str, tl: Timeline, pending, shapes, busy) -> None:
    kind = ins.opcode.removesuffix('-start')
    coll = self.costs.collective_in(ins)
    begin = tl.seconds
    if coll is not None:
      kind = coll.opcode.removesuffix('-start')
      s, label = self._collective_seconds(ins, coll, shapes, asynchronous=True)
      begin = self._take_links(coll, tl.seconds, s, busy)
      tl.comm += s
      tl.count(label, s)
    else:  # copy-start, slice-start, other async work: a DMA of the result
      s = dma_seconds(ins.shape, self.chip)
      kind = kind if kind in DMA else 'async'
    pending[ins.name] = {
        'computation': comp, 'start': ins.name, 'kind': kind, 'collective': coll is not None,
        'channel': channel(coll),
        'op_name': ins.op_name, 'bytes': sum(shape_bytes(shapes.get(o, '')) for o in
                                             ins.operands),
        'transfer_s': s, 'finish': begin + s, 'queued_s': begin - tl.seconds, 'compute': 0.0,
        'einsums': [], 'route': self._route(coll)}

  def _route(self, coll: Instr | None) -> tuple[int, int]:
    """``route`` of a collective-permute (memoized by its pairs); (1, 1) for others."""
    if coll is None or coll.opcode.removesuffix('-start') != 'collective-permute':
      return 1, 1
    pairs = tuple(source_target_pairs(coll.attrs))
    if pairs not in self.routes:
      self.routes[pairs] = route(pairs, self.coords)
    return self.routes[pairs]

  def _done(self, ins: Instr, tl: Timeline, pending, by_name) -> None:
    if self.costs.async_role(ins) == 'done':  # an async collective fusion: by channel
      ch = channel(self.costs.collective_in(ins))
      start = next((k for k, p in pending.items() if p['channel'] == ch), None)
    else:
      start = _carrier(ins, by_name, pending)
    p = pending.pop(start, None)
    if p is None:
      self.warnings.append(f'{ins.name}: no matching start')
      return
    wait = max(0.0, p['finish'] - tl.seconds)
    tl.seconds += wait
    if p['collective']:
      tl.exposed_comm += wait
      if wait:
        tl.expose(exposed_key(p['kind'], True, p['op_name']), wait)
    else:
      tl.exposed_dma += wait
    if p['collective']:
      self.pairs.append({
          'computation': p['computation'], 'start': p['start'], 'done': ins.name,
          'kind': p['kind'], 'op_name': p['op_name'], 'bytes': p['bytes'],
          'transfer_us': p['transfer_s'] * 1e6, 'compute_between_us': p['compute'] * 1e6,
          'exposed_us': wait * 1e6, 'einsums_between': p['einsums'],
          'queued_us': p['queued_s'] * 1e6, 'link_load': p['route'][0],
          'hops': p['route'][1]})

  def trip_count(self, ins: Instr, comp: str) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if m:
      return int(m.group(1))
    cond = self.m.computations.get(ins.attr('condition'), [])
    by_name = {i.name: i for i in cond}
    root = next((i for i in cond if i.root), None)
    parent = {i.name: i for i in self.m.computations[comp]}
    try:
      a, b = (by_name[o] for o in root.operands)
      direction = re.search(r'direction=(\w+)', root.attrs).group(1)
      if a.opcode == 'constant':
        a, b = b, a
        direction = {'GT': 'LT', 'GE': 'LE', 'LT': 'GT', 'LE': 'GE'}.get(direction, direction)
      bound = int(b.literal)
      index = int(re.search(r'index=(\d+)', a.attrs).group(1))
      init = _constant(parent, parent[ins.operands[0]], index)
      span = {'LT': bound - init, 'LE': bound - init + 1, 'NE': bound - init}[direction]
      return max(-(-span // self._increment(ins.attr('body'), index)), 0)
    except (AttributeError, KeyError, StopIteration, TypeError, ValueError, IndexError):
      self.warnings.append(f'{ins.name}: trip count not found, counted once')
      return 1

  def _increment(self, body: str, index: int) -> int:
    """How much the loop counter (tuple element ``index``) grows per iteration."""
    instrs = self.m.computations.get(body, [])
    by_name = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.root), None)
    x = by_name.get(root.operands[index]) if root and root.opcode == 'tuple' else None
    if x is not None and x.opcode == 'add':
      for o in x.operands:
        c = by_name.get(o)
        while c is not None and c.opcode in ('copy', 'bitcast', 'convert'):
          c = by_name.get(c.operands[0])
        if c is not None and c.opcode == 'constant' and re.fullmatch(r'-?\d+', c.literal):
          return max(int(c.literal), 1)
    return 1

  def executions(self) -> dict[str, float]:
    """How many times each computation runs per step."""
    out: dict[str, float] = {}

    def count(c: str) -> float:
      if c == self.m.entry:
        return 1.0
      if c not in out:
        out[c] = 0.0  # guards recursion
        out[c] = sum(count(caller) * t for caller, t in self.calls.get(c, []))
      return out[c]

    return {c: count(c) for c in self.m.computations}



def dma_seconds(shape: str, chip: Chip) -> float:
  """An asynchronous copy's or slice's time: its bytes once for each of its two ends
  (elements 0 and 1 of its result tuple) in HBM, at least once. A prefetch into another
  memory space or an eviction from it (the v4 compiler's memory-space assignment, ``S(3)``
  in the layout) crosses HBM once; the other memory spaces are taken to be no slower."""
  in_hbm = sum(memory_space(shape, k) == 0 for k in (0, 1))
  return max(in_hbm, 1) * shape_bytes(tuple_element(shape, 1)) / chip.hbm_rate


def exposed_key(kind: str, asynchronous: bool, op_name: str) -> str:
  """The ``exposed_by`` key of a collective the chip waited for: its kind, whether it was
  asynchronous (waited for at its done) or blocked the chip, and its op_name (empty for a
  collective the compiler made without one, such as its reductions of partial sums)."""
  return f"{kind} ({'async' if asynchronous else 'sync'}) @ {op_name}"


UNNAMED = "the compiler's "


def unnamed_key(ins: Instr) -> str:
  """The ``non_matmul_by_op`` key of an instruction with no op_name (one the compiler
  added: a layout copy, a loop's buffer copy): its opcode and shape with the layout, minus
  the tiling, as ``the compiler's copy bf16[2,2048,20480]{1,2,0}``. Two copies of one
  array differ only in their layouts."""
  shape = re.sub(r':[^{}]*}', '}', ins.shape)
  return f'{UNNAMED}{ins.opcode} {shape if len(shape) <= 80 else shape[:77] + "..."}'


def split_exposed_key(key: str) -> tuple[str, str]:
  """(kind with '(sync)' or '(async)', op_name) of an ``exposed_by`` key."""
  kind, op_name = key.split(' @ ', 1)
  return kind, op_name


COMPUTE_TERMS = ('matmul at MXU rate', 'matmul HBM-bound excess', 'non-matmul',
                 'partial-sum additions', 'Pallas grid steps')
MXU, HBM_EXCESS, NON_MATMUL, ADDITIONS, GRID_STEPS = COMPUTE_TERMS


def term_key(where: str, term: str) -> str:
  """The ``compute_terms`` key of ``term`` (one of COMPUTE_TERMS) for ``where`` ('ring' or
  'plain')."""
  return f'{where}: {term}'


def compute_terms(op_name: str, mxu_seconds: float, seconds: float,
                  grid_steps: float = 0.0) -> list[tuple[str, float]]:
  """One instruction's compute time split into terms, each ``(where, term)``: where is
  ``ring`` for instructions of a decomposed collective einsum (their op_name names
  ``collective_einsum``), else ``plain``; the terms are its matmul FLOPs at the MXU rate,
  the time its HBM traffic takes beyond that (memory-bound matmuls), or all of it for an
  instruction with no matmul (elementwise work, copies, reductions, updates), where a
  ring's additions of partial sums (op_name under ``ring.ADDITIONS_SCOPE``) are a term of
  their own. A Pallas kernel's ``grid_steps`` (its grid steps' fixed cost, part of
  ``seconds``) are a term of their own too."""
  where = 'ring' if RING_SCOPE in op_name else 'plain'
  steps = [(term_key(where, GRID_STEPS), grid_steps)] if grid_steps else []
  if not mxu_seconds:
    adds = where == 'ring' and f'/{ADDITIONS_SCOPE}/' in op_name
    return [(term_key(where, ADDITIONS if adds else NON_MATMUL), seconds - grid_steps)] + steps
  return [(term_key(where, MXU), mxu_seconds),
          (term_key(where, HBM_EXCESS), seconds - grid_steps - mxu_seconds)] + steps


def _carrier(ins: Instr, by_name: dict[str, Instr], pending: dict) -> str | None:
  """The pending async start a ``*-done`` waits for (through tuple elements and
  async updates)."""
  for name in ins.operands:
    x = by_name.get(name)
    while x is not None and x.opcode in ('get-tuple-element', 'bitcast', 'async-update'):
      x = by_name.get(x.operands[0]) if x.operands else None
    if x is not None and x.name in pending:
      return x.name
  return None


def _constant(instrs: dict[str, Instr], tup: Instr, index: int) -> int:
  """The integer the ``index``-th element of a while's initial tuple starts at."""
  x = instrs[tup.operands[index]] if tup.opcode == 'tuple' else None
  while x is not None and x.opcode in ('copy', 'bitcast', 'convert'):
    x = instrs.get(x.operands[0])
  if x is None or x.opcode != 'constant':
    raise ValueError('not a constant')
  return int(x.literal)


TOLERANCE_POINTS = 5.0  # the calibration's target: modeled within this many MFU points
CALIBRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           'docs', 'calibration.json')


def calibration_summary() -> str:
  """The model's error against measured MFU (docs/calibration.json, written by
  ``python -m benchmarks.calibrate``), to show next to every modeled number."""
  if not os.path.exists(CALIBRATION):
    return 'not calibrated yet (python -m benchmarks.calibrate)'
  with open(CALIBRATION, encoding='utf-8') as f:
    stored = json.load(f)
  rows = stored['rows']
  errors = ', '.join(f"{r['config']} {r['modeled']['error_points']:+.1f}" for r in rows)
  worst = max(abs(r['modeled']['error_points']) for r in rows)
  over = f', above the {TOLERANCE_POINTS:g}-point tolerance' if worst > TOLERANCE_POINTS else ''
  held_out = stored.get('leave_one_out') or {}
  loo = (f"; each row fitted on the others alone, worst "
         f"{max(abs(v['error_points']) for v in held_out.values()):.1f}" if held_out else '')
  return (f'modeled minus measured MFU on MaxText\'s measured runs, in points: {errors} (worst '
          f'{worst:.1f}{over}{loo})')


def analyze(text: str | Module, chip: Chip, coords=None) -> Result:
  """Models one step of the compiled program ``text`` on ``chip``.

  Args:
    text: scheduled HLO text (``compiled.as_text()``), or its ``parse``d module (a
      program modeled under several chips is parsed once).
    chip: the chip's rates (``Chip.from_profile('tpu_v4')``).
    coords: optional physical coordinates of each partition id (for the torus
      dimensions a collective's group spans).
  """
  module = parse(text) if isinstance(text, str) else text
  model = _Model(module, chip, coords)
  tl = model.run(module.entry)
  runs = model.executions()
  for p in model.pairs:
    p['executions'] = runs.get(p['computation'], 0.0)
  return Result(tl.seconds, tl.compute, tl.comm, tl.exposed_comm, tl.exposed_dma, tl.flops,
                tl.hbm_bytes, {k: {'count': n, 'seconds': s} for k, (n, s) in
                               sorted(tl.by_kind.items())},
                dict(sorted(tl.by_term.items())),
                dict(sorted(tl.by_op.items(), key=lambda kv: -kv[1])), model.pairs,
                dict(sorted(tl.exposed_by.items(), key=lambda kv: -kv[1])), model.warnings,
                dict(sorted(tl.by_kernel.items(), key=lambda kv: -kv[1])))
