"""Reading compiled HLO text: which collectives run over which mesh axis."""

import re

import numpy as np

COLLECTIVE = re.compile(r'\b(all-gather|reduce-scatter|all-reduce|all-to-all)(-start)?\(')


def _iota(dims, perm=None):
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _ints(text):
  return [int(x) for x in re.findall(r'\d+', text)]


def replica_groups(line: str) -> list[list[int]]:
  """Device groups of one collective, in any of XLA's three printed formats."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if m:
    sizes = _ints(m.group(1))
    names = re.findall(r"'(\w+)'=", m.group(1))
    over = re.findall(r"'(\w+)'", m.group(2))
    ids = re.search(r'device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)', line)
    devices = (_iota(_ints(ids.group(1)), ids.group(2) and _ints(ids.group(2))).ravel()
               if ids else np.arange(int(np.prod(sizes))))
    grid = devices.reshape(sizes)
    axes = [names.index(a) for a in over]
    rest = [i for i in range(len(sizes)) if i not in axes]
    return grid.transpose(rest + axes).reshape(-1, int(np.prod([sizes[a] for a in axes]))).tolist()
  m = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', line)
  if m:
    shape = _ints(m.group(1))
    return _iota(_ints(m.group(2)), m.group(3) and _ints(m.group(3))).reshape(shape).tolist()
  m = re.search(r'replica_groups=\{(.*?)\}\}', line)
  if m:
    return [_ints(g) for g in re.findall(r'\{([\d,]+)', m.group(1) + '}')]
  return []


def collectives_over(hlo: str, mesh, axis: str, op_name_filter=None) -> list[str]:
  """Collective instructions whose groups span ``axis`` of ``mesh``.

  ``op_name_filter(op_name) -> bool`` keeps only instructions whose metadata
  op_name it accepts.
  """
  coords = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
  which = list(mesh.axis_names).index(axis)
  found = []
  for line in hlo.splitlines():
    if not COLLECTIVE.search(line):
      continue
    name = re.search(r'op_name="([^"]*)"', line)
    if op_name_filter and not (name and op_name_filter(name.group(1))):
      continue
    for group in replica_groups(line):
      if len({coords[d][which] for d in group}) > 1:
        found.append(line.split('=')[0].strip())
        break
  return found


def permute_offsets(hlo: str, mesh, axis: str) -> list[int]:
  """For each collective-permute: how far along ``axis`` its data moves (mod size)."""
  coords = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
  which, n = list(mesh.axis_names).index(axis), mesh.shape[axis]
  offsets = []
  for line in hlo.splitlines():
    if not re.search(r'collective-permute(-start)?\(', line):
      continue
    pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', line).group(1)
    src, dst = _ints(pairs.split('}')[0])[:2]
    offsets.append((coords[dst][which] - coords[src][which]) % n)
  return offsets
