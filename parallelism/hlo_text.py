"""Reading compiled XLA HLO text: computations, instructions, shapes, device groups.

``parse(compiled.as_text())`` gives each computation's instructions in the
printed (for a scheduled module: execution) order. Operands are referenced by
name; look their shapes up in the same computation. A Pallas kernel's grid and block
matmuls come from the Mosaic module its backend config carries (``kernel_grid``).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import math
import re

import numpy as np

DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2,
               's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8,
               'c128': 16, 's4': 0.5, 'u4': 0.5, 'token': 0}


@dataclasses.dataclass
class Instr:
  """One HLO instruction: ``%name = shape opcode(operands), attrs``."""
  name: str
  shape: str
  opcode: str
  operands: list[str]   # names of operand instructions
  literal: str          # the raw operand text (constants' values)
  attrs: str            # everything after the operand list
  root: bool = False

  def attr(self, key: str) -> str | None:
    m = re.search(rf'\b{key}=(%?[\w.\-]+)', self.attrs)
    return m and m.group(1).lstrip('%')

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attrs)
    return m.group(1) if m else ''


@dataclasses.dataclass
class Module:
  """Computation name -> its instructions in order; which one is the entry."""
  computations: dict[str, list[Instr]]
  entry: str
  num_partitions: int


def _matching(text: str, start: int) -> int:
  """Index just past the parenthesis group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {'(': 1, ')': -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  raise ValueError(f'unbalanced parentheses: {text[start:start + 80]}')


_HEAD = re.compile(r'^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*')
_ARRAY = re.compile(r'[a-z][a-z0-9]*\[[0-9,]*\](\{[^}]*\})?')


def parse_instr(line: str) -> Instr | None:
  m = _HEAD.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith('('):
    end = _matching(rest, 0)
  else:
    a = _ARRAY.match(rest)
    if not a:
      return None
    end = a.end()
  shape, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    return None
  close = _matching(rest, op.end() - 1)
  inner = re.sub(r'/\*.*?\*/', '', rest[op.end():close - 1])
  return Instr(m.group(2), shape, op.group(1), re.findall(r'%([\w.\-]+)', inner), inner,
               rest[close:], bool(m.group(1)))


def _statements(lines):
  """HLO lines with an instruction's continuation lines joined to it.

  A Pallas kernel's ``frontend_attributes`` hold a JSON string with newlines,
  so one instruction can span lines (the next starts ``}}, metadata=``); a
  computation ends at a line that is a lone ``}``.
  """
  pending = None
  for line in lines:
    if line.strip() == '}' or _HEAD.match(line) or re.match(r'^(ENTRY\s+)?%', line):
      if pending is not None:
        yield pending
      pending = line
    elif pending is not None:
      pending += ' ' + line.strip()
    else:
      yield line
  if pending is not None:
    yield pending


def parse(text: str) -> Module:
  """Splits HLO text into computations of instructions, in schedule order."""
  comps, entry, current = {}, None, None
  parts = re.search(r'num_partitions=(\d+)', text[:20000])
  for line in _statements(text.splitlines()):
    if current is None:
      m = re.match(r'^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$', line)
      if m:
        current = comps.setdefault(m.group(2), [])
        entry = m.group(2) if m.group(1) else entry
      continue
    if line.strip() == '}':
      current = None
      continue
    ins = parse_instr(line)
    if ins:
      current.append(ins)
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  return Module(comps, entry, int(parts.group(1)) if parts else 1)


def shape_bytes(shape: str) -> float:
  return sum(DTYPE_BYTES.get(d, 4) * math.prod(int(x) for x in dims.split(',') if x)
             for d, dims in re.findall(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]', shape))


def shape_dims(shape: str) -> list[int]:
  m = re.search(r'\[([0-9,]*)\]', shape)
  return [int(x) for x in m.group(1).split(',') if x] if m else []


def tuple_element(shape: str, k: int) -> str:
  """The ``k``-th array shape of a (flattened) tuple shape, e.g. a copy-start's result."""
  parts = re.findall(r'[a-z][a-z0-9]*\[[0-9,]*\]', shape)
  return parts[k] if len(parts) > k else (parts[0] if parts else '')


def memory_space(shape: str, k: int) -> int:
  """The memory space of the ``k``-th array of a (flattened) tuple shape: the ``S(n)`` of
  its layout, 0 (HBM, the default) where the layout names none."""
  layouts = re.findall(r'[a-z][a-z0-9]*\[[0-9,]*\](\{[^}]*\})?', shape)
  m = re.search(r'S\((\d+)\)', layouts[k]) if len(layouts) > k else None
  return int(m.group(1)) if m else 0


def _iota(dims, perm=None) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
  return [int(x) for x in re.findall(r'\d+', text)]


def replica_groups(attrs: str, num_partitions: int) -> list[list[int]]:
  """Every device group of a collective, in any of XLA's printed formats.

  Mesh axis names are read as names (``'tensor2'=4`` is one axis of size 4);
  a collective that prints no groups spans all ``num_partitions``.
  """
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", attrs)
  if m:
    names = re.findall(r"'(\w+)'=", m.group(1))
    sizes = [int(x) for x in re.findall(r"'\w+'=(\d+)", m.group(1))]
    devices = (_iota(_ints(m.group(2)), m.group(3) and _ints(m.group(3))).ravel()
               if m.group(2) else np.arange(math.prod(sizes)))
    over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
    rest = [i for i in range(len(sizes)) if i not in over]
    grid = devices.reshape(sizes).transpose(rest + over)
    return grid.reshape(-1, math.prod(sizes[a] for a in over)).tolist()
  m = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', attrs)
  if m:
    shape = _ints(m.group(1))
    return _iota(_ints(m.group(2)), m.group(3) and _ints(m.group(3))).reshape(
        shape[0], -1).tolist()
  m = re.search(r'replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}', attrs)
  if m:
    return [_ints(g) for g in re.findall(r'\{([\d,]*)\}', m.group(1))]
  return [list(range(num_partitions))]


def first_group(attrs: str, num_partitions: int) -> list[int]:
  """The first device group of a collective (see ``replica_groups``)."""
  return replica_groups(attrs, num_partitions)[0]


GROUP_COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all')


def collective_counts(module: Module) -> dict[str, int]:
  """How many of each collective (``GROUP_COLLECTIVES`` and collective-permutes, sync or
  async) the module's computations hold, by opcode."""
  kinds = GROUP_COLLECTIVES + ('collective-permute',)
  counts = collections.Counter(i.opcode.removesuffix('-start')
                               for instrs in module.computations.values() for i in instrs)
  return {op: n for op, n in sorted(counts.items()) if op in kinds}


def _mesh_coords(mesh, axis: str) -> tuple[dict[int, int], int]:
  """({device id: its position along ``axis``}, the axis size)."""
  which = list(mesh.axis_names).index(axis)
  return {d.id: idx[which] for idx, d in np.ndenumerate(mesh.devices)}, mesh.shape[axis]


def collectives_over(module: Module, mesh, axis: str, op_name_filter=None) -> list[str]:
  """Names of the collectives (``GROUP_COLLECTIVES``, sync or async) whose device
  groups span ``axis`` of ``mesh``; ``op_name_filter(op_name) -> bool`` keeps only
  instructions whose metadata op_name it accepts."""
  coords, _ = _mesh_coords(mesh, axis)
  found = []
  for ins in (i for instrs in module.computations.values() for i in instrs):
    if ins.opcode.removesuffix('-start') not in GROUP_COLLECTIVES:
      continue
    if op_name_filter and not op_name_filter(ins.op_name):
      continue
    groups = replica_groups(ins.attrs, module.num_partitions)
    if any(len({coords[d] for d in g}) > 1 for g in groups):
      found.append(ins.name)
  return found


def source_target_pairs(attrs: str) -> list[tuple[int, int]]:
  """A collective-permute's (source, target) device pairs."""
  m = re.search(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}', attrs)
  return [(int(a), int(b)) for a, b in re.findall(r'\{(\d+),(\d+)\}', m.group(1))] if m else []


def permute_offsets(module: Module, mesh, axis: str) -> list[int]:
  """For each collective-permute: how far along ``axis`` its data moves (mod the size)."""
  coords, n = _mesh_coords(mesh, axis)
  offsets = []
  for ins in (i for instrs in module.computations.values() for i in instrs):
    if ins.opcode.removesuffix('-start') == 'collective-permute':
      src, dst = source_target_pairs(ins.attrs)[0]
      offsets.append((coords[dst] - coords[src]) % n)
  return offsets


# ---- Pallas (Mosaic) kernels ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelGrid:
  """A Pallas kernel's grid and block matmuls, as its serialized Mosaic body states them.

  ``bounds`` are the grid's sizes (``iteration_bounds``; none for a kernel without a
  grid), ``parallel`` says for each whether its ``dimension_semantics`` is parallel
  (``parallel`` or ``core_parallel``: Mosaic may split it over a chip's TensorCores), and
  ``matmuls`` is the ``(m, k, n)`` of each matmul in the kernel's body (one grid step's
  blocks; ``k`` contracted, ``n`` the right operand's other dimensions).
  """
  bounds: tuple[int, ...]
  parallel: tuple[bool, ...]
  matmuls: tuple[tuple[int, int, int], ...]

  @property
  def steps(self) -> int:
    return math.prod(self.bounds)


_BODY = re.compile(r'"custom_call_config\\?"\s*:\s*\{\s*\\?"body\\?"\s*:\s*\\?"([A-Za-z0-9+/=]*)')


def kernel_grid(ins: Instr) -> KernelGrid | None:
  """The grid of a Pallas kernel (a ``tpu_custom_call``, whose backend config carries the
  Mosaic kernel as base64 MLIR bytecode), read with jaxlib's MLIR bindings; None for any
  other instruction. Raises ValueError naming the instruction when its body is missing or
  does not read as a Mosaic kernel with a grid."""
  if 'custom_call_target="tpu_custom_call"' not in ins.attrs:
    return None
  body = _BODY.search(ins.attrs)
  try:
    if not body:
      raise ValueError('its backend config carries no Mosaic body')
    return mosaic_grid(body.group(1))
  except Exception as e:  # pylint: disable=broad-except  (MLIR raises its own types)
    raise ValueError(f'Pallas kernel %{ins.name} ({ins.op_name or "no op_name"}): cannot read '
                     f'its grid: {e}') from e


@functools.lru_cache(maxsize=None)
def mosaic_grid(body: str) -> KernelGrid:
  """The grid of a Mosaic kernel serialized as ``body`` (base64 MLIR bytecode, as a
  ``tpu_custom_call`` carries it); cached: a program repeats its kernels."""
  from jaxlib.mlir import ir  # pylint: disable=g-import-not-at-top
  from jaxlib.mosaic.python import tpu  # pylint: disable=g-import-not-at-top
  ctx = ir.Context()
  tpu.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  with ctx, ir.Location.unknown():
    module = ir.Module.parse(base64.b64decode(body, validate=True))
    grids = [op.attributes for op in module.body.operations
             if op.operation.name.endswith('func.func') and
             'dimension_semantics' in op.attributes]
    if len(grids) != 1:
      raise ValueError(f'{len(grids)} kernel functions with dimension_semantics, not one')
    semantics = re.findall(r'dimension_semantics<(\w+)>', str(grids[0]['dimension_semantics']))
    bounds = (tuple(ir.DenseI64ArrayAttr(grids[0]['iteration_bounds']))
              if 'iteration_bounds' in grids[0] else ())
    if len(bounds) != len(semantics) or any(b < 0 for b in bounds):
      raise ValueError(f'grid {bounds} with dimension semantics {semantics}')
    matmuls = []

    def visit(op):
      if op.name.endswith('tpu.matmul'):
        matmuls.append(_matmul_mkn(op, ir))
      return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
  return KernelGrid(bounds, tuple(s in ('parallel', 'core_parallel') for s in semantics),
                    tuple(matmuls))


def _matmul_mkn(op, ir) -> tuple[int, int, int]:
  """(m, k, n) of a Mosaic ``tpu.matmul``: from its operands' shapes and dimension numbers
  (``[lhs contracting], [rhs contracting], [lhs other], [rhs other], ...``)."""
  lhs, rhs = (list(ir.VectorType(o.type).shape) for o in list(op.operands)[:2])
  if 'dimension_numbers' not in op.attributes:
    raise ValueError(f'a matmul without dimension numbers: {op}')
  groups = [_ints(g) for g in re.findall(r'\[([\d, ]*)\]', str(op.attributes['dimension_numbers']))]
  lc, _, lo, ro = groups[:4]
  size = lambda shape, idx: math.prod(shape[i] for i in idx)
  return size(lhs, lo), size(lhs, lc), size(rhs, ro)
