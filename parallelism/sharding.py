"""Logical axis names -> mesh shardings.

The config holds an ordered table of rules ``[[logical, mesh_axes], ...]``
(``mesh_axes``: a mesh axis name, a list of them, or None). For each dimension
of an array, the first rule for its logical name whose mesh axes are not
already used by another dimension of the same array wins (MaxText semantics);
names without a rule are replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.moe import AT_EXPERTS, DISPATCHED
from models.ops import Axes, Ops
from parallelism import moe
from parallelism.collective_einsum import RING_DTYPES, explain, run_decision

Rules = tuple[tuple[str, tuple[str, ...]], ...]


def normalize_rules(table: Iterable[Sequence[Any]]) -> Rules:
  """Turns the config's rule table into a hashable tuple of tuples."""
  rules = []
  for row in table:
    if len(row) != 2:
      raise ValueError(f'logical axis rule {row!r} is not a [logical, mesh_axes] pair')
    logical, axes = row
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    rules.append((str(logical), axes))
  return tuple(rules)


def logical_to_spec(axes: Axes, rules: Rules) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec by first-fit over ``rules``."""
  used: set[str] = set()
  spec = []
  for name in axes:
    choice = None
    for logical, mesh_axes in rules:
      if logical == name and not used.intersection(mesh_axes):
        choice = mesh_axes
        break
    if choice:
      used.update(choice)
      spec.append(choice[0] if len(choice) == 1 else choice)
    else:
      spec.append(None)
  return PartitionSpec(*spec)


def _var_axes(var: nnx.Variable, ndim: int) -> Axes:
  axes = var.get_metadata().get('out_sharding') or (None,) * ndim
  return tuple(axes)


def state_specs(tree: Any, rules: Rules) -> Any:
  """PartitionSpec for every leaf of an (abstract) tree holding NNX Variables.

  Variables are mapped through their logical axes; other leaves (step
  counters, optimizer counts) are replicated. Optimizer states built by optax
  from an NNX state hold Variables too, so they inherit their parameters'
  layout.
  """
  def spec(x):
    if isinstance(x, nnx.Variable):
      return x.replace(logical_to_spec(_var_axes(x, x.ndim), rules))
    return PartitionSpec()
  return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_divisible(abstract_state: Any, specs: Any, mesh: jax.sharding.Mesh) -> None:
  """Raises ValueError naming every parameter whose dims the mesh cannot split."""
  bad = []
  leaves = jax.tree_util.tree_leaves_with_path(abstract_state)
  for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=_is_spec)):
    for dim, axes in zip(leaf.shape, spec):
      size = mesh_axis_size(mesh, axes)
      if dim % size:
        name = jax.tree_util.keystr(path, simple=True, separator='.').removesuffix('.value')
        bad.append(f'{name} dim {dim} over {axes} ({size})')
  if bad:
    raise ValueError('parameter dims not divisible by their mesh axes: ' + '; '.join(bad))


def mesh_axis_size(mesh: jax.sharding.Mesh, axes: Any) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return size


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def named(mesh: jax.sharding.Mesh, specs: Any) -> Any:
  """PartitionSpec tree -> NamedSharding tree."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


@dataclasses.dataclass(frozen=True)
class MatmulPolicy:
  """The ``parallelism.*`` config: when dense layers use collective einsums."""
  collective_matmul: str = 'auto'       # auto | always | never
  direction: str = 'unidirectional'     # for 'always': unidirectional | bidirectional
  unroll: int = 1                       # ring steps per loop iteration: 1 | 2
  hardware: str = 'cpu'                 # profile the cost model uses under 'auto'
  ring_dtype: str = 'compute'           # reduce-scatter accumulators on the wire: compute | float32

  @classmethod
  def from_config(cls, cfg: Any) -> 'MatmulPolicy':
    """``parallelism.*`` plus ``hardware.name``, the profile the cost model uses."""
    p = cfg.parallelism
    return cls(p.collective_matmul, p.direction, p.unroll, cfg.hardware.name, p.ring_dtype)

  def validate(self) -> None:
    choices = {'collective_matmul': ('auto', 'always', 'never'),
               'direction': ('unidirectional', 'bidirectional'), 'unroll': (1, 2),
               'ring_dtype': RING_DTYPES}
    for key, allowed in choices.items():
      if getattr(self, key) not in allowed:
        raise ValueError(f'parallelism.{key}={getattr(self, key)!r} is not one of {allowed}')


class ShardedOps(Ops):
  """Ops that turn logical axes into shardings and dense layers into collective einsums.

  Every dense layer's einsum is planned from the shardings its logical axes
  imply (parallelism/collective_einsum.py); under ``policy.collective_matmul``
  it runs decomposed or plain. The decision of every layer traced so far is
  in ``decisions`` (layer path -> (Decision, specs)); the startup report
  reads it.
  """

  def __init__(self, mesh: jax.sharding.Mesh, rules: Rules,
               policy: MatmulPolicy = MatmulPolicy(collective_matmul='never')):
    self.mesh, self.rules, self.policy = mesh, rules, policy
    self.decisions: dict[str, Any] = {}

  def spec(self, axes: Axes) -> PartitionSpec:
    return logical_to_spec(axes, self.rules)

  def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
    sharding = NamedSharding(self.mesh, self.spec(axes))
    return jax.lax.with_sharding_constraint(x, sharding)

  def einsum(self, equation, x, w, *, x_axes, w_axes, out_axes, name):
    specs = tuple(self.spec(a) for a in (x_axes, w_axes, out_axes))
    decision = self._decide(equation, x, w, specs)
    self.decisions[name] = (decision, specs)
    with jax.named_scope(name):  # names the layer's ops (and collectives) in HLO
      return run_decision(decision, x, w, mesh=self.mesh, lhs_spec=specs[0],
                          rhs_spec=specs[1], out_spec=specs[2], unroll=self.policy.unroll,
                          ring_dtype=self.policy.ring_dtype)

  def local(self, fn, *args, in_axes, out_axes):
    """``fn`` in a ``shard_map`` over the whole mesh, on the blocks the specs give."""
    in_specs = tuple(self.spec(a) for a in in_axes)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=self.spec(out_axes),
                         check_vma=False)(*args)

  def experts(self, x_becd, expert_fn, *, chunks, flops, name):
    """The expert all-to-all, single or chunked as parallelism/moe.py decides."""
    dispatched, at_experts = self.spec(DISPATCHED), self.spec(AT_EXPERTS)
    axis = at_experts[0] if isinstance(at_experts[0], str) else None
    if axis is not None and self.mesh.shape[axis] > 1:
      moe.check_layout(axis, dispatched, at_experts)
    decision = moe.decide(x_becd.shape, x_becd.dtype.itemsize, flops, self.mesh, axis, chunks,
                          self.policy.collective_matmul, self.policy.hardware)
    self.decisions[name] = (decision, (dispatched, at_experts))
    with jax.named_scope(name):
      return moe.run(decision, x_becd, expert_fn, self.mesh, dispatched, at_experts)

  def _decide(self, equation, x, w, specs):
    decide = lambda mode: explain(
        equation, x.shape, w.shape, jnp.result_type(x.dtype, w.dtype), mesh=self.mesh,
        lhs_spec=specs[0], rhs_spec=specs[1], out_spec=specs[2], mode=mode,
        hardware=self.policy.hardware, ring_dtype=self.policy.ring_dtype)
    setting = self.policy.collective_matmul
    if setting == 'never':
      return decide('none')
    if setting == 'auto':
      return decide('auto')
    try:  # 'always': every eligible layer
      return decide(self.policy.direction)
    except ValueError:  # not eligible: 'auto' returns 'none' with the reason
      return decide('auto')

  def __hash__(self):
    return hash((self.mesh, self.rules, self.policy))

  def __eq__(self, other):
    return (type(other) is type(self) and self.mesh == other.mesh
            and self.rules == other.rules and self.policy == other.policy)
