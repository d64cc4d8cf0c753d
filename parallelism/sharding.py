"""Logical axis names -> mesh shardings.

The config holds an ordered table of rules ``[[logical, mesh_axes], ...]``
(``mesh_axes``: a mesh axis name, a list of them, or None). For each dimension
of an array, the first rule for its logical name whose mesh axes are not
already used by another dimension of the same array wins (MaxText semantics);
names without a rule are replicated.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import types
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.moe import AT_EXPERTS, DISPATCHED
from models.ops import Axes, Ops, saved
from parallelism import mesh as mesh_lib
from parallelism import moe, plan_file, schedule
from parallelism.collective_einsum import ring_order_fits, run_decision
from parallelism.decision import RING_DTYPES, explain
from parallelism.einsum_plan import axes_of, spec_entry

Rules = tuple[tuple[str, tuple[str, ...]], ...]
T = TypeVar('T')


def normalize_rules(table: Iterable[Sequence[Any]]) -> Rules:
  """Turns the config's rule table into a hashable tuple of tuples."""
  rules = []
  for row in table:
    if isinstance(row, str) or len(row) != 2:
      raise ValueError(f'logical axis rule {row!r} is not a [logical, mesh_axes] pair')
    logical, axes = row
    if axes is not None and not isinstance(axes, (str, list, tuple)):
      axes = [axes]
    bad = [a for a in axes_of(axes) if a not in mesh_lib.AXES]
    if not isinstance(logical, str) or bad:
      raise ValueError(f'mesh.logical_axis_rules row {list(row)!r}: '
                       f'{bad[0] if bad else logical!r} is not '
                       f'{"one of " + ", ".join(mesh_lib.AXES) if bad else "a logical axis name"}')
    rules.append((logical, axes_of(axes)))
  return tuple(rules)


# Logical axes along a sequence: rules may split them (sequence parallelism) in training.
SEQUENCE_AXES = ('length', 'residual_length', 'cache_length')


def decode_rules(rules: Rules) -> Rules:
  """``rules`` for decoding: without the sequence axes, since one new token has no
  sequence to split."""
  return tuple(rule for rule in rules if rule[0] not in SEQUENCE_AXES)


def logical_to_spec(axes: Axes, rules: Rules) -> PartitionSpec:
  """Maps logical axis names to a PartitionSpec by first-fit over ``rules``."""
  used: set[str] = set()
  spec = []
  for name in axes:
    choice = next((mesh_axes for logical, mesh_axes in rules
                   if logical == name and not used.intersection(mesh_axes)), ())
    used.update(choice)
    spec.append(spec_entry(choice))
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


def mesh_axis_size(mesh: jax.sharding.Mesh, spec_entry: Any) -> int:
  """How many devices one PartitionSpec entry splits a dimension over."""
  return math.prod(mesh.shape[a] for a in axes_of(spec_entry))


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def named(mesh: jax.sharding.Mesh, specs: Any) -> Any:
  """PartitionSpec tree -> NamedSharding tree."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


# What ``parallelism.layer_overrides`` may ask of a layer: as collective_matmul decides
# (auto), a ring (always), the compiler's collectives (plain), or auto's decision with the
# weight gradient free to ring alone beside a forward left to the compiler (gradients:
# where its reduce-scatter would block the chip; ``decision._gradients_alone``).
LAYER_FORMS = ('auto', 'ring', 'plain', 'gradients')
COLLECTIVE_MATMUL = ('auto', 'always', 'never')


@dataclasses.dataclass(frozen=True)
class MatmulPolicy:
  """The ``parallelism.*`` config: which dense layers run as collective einsums. How each
  ring runs is the planner's (``parallelism/schedule.py``); ``prefer`` sets schedule fields
  for every ring instead, where they apply (experiments and tests; not a config key)."""
  collective_matmul: str = 'auto'       # auto | always | never
  hardware: str = 'cpu'                 # profile the cost model and the schedule use
  ring_dtype: str = 'compute'           # rings' partial sums (wire, between steps): compute | float32
  layer_overrides: tuple[tuple[str, str], ...] = ()  # (layer path pattern, LAYER_FORMS)
  prefer: tuple[tuple[str, Any], ...] = ()  # schedule fields for every ring (schedule.py)

  @classmethod
  def from_config(cls, cfg: Any) -> 'MatmulPolicy':
    """``parallelism.*`` plus ``hardware.name``, the profile the cost model uses."""
    p = cfg.parallelism
    return cls(p.collective_matmul, cfg.hardware.name, p.ring_dtype,
               parse_overrides(p.layer_overrides))

  def validate(self) -> None:
    choices = {'collective_matmul': COLLECTIVE_MATMUL, 'ring_dtype': RING_DTYPES}
    for key, allowed in choices.items():
      if getattr(self, key) not in allowed:
        raise ValueError(f'parallelism.{key}={getattr(self, key)!r} is not one of {allowed}')
    schedule.check_prefer(dict(self.prefer))

  def override(self, name: str) -> tuple[str, str] | None:
    """The first ``layer_overrides`` entry (pattern, form) layer ``name`` matches, or None."""
    return next(((p, f) for p, f in self.layer_overrides if fnmatch.fnmatchcase(name, p)),
                None)

  def choose(self, decide: Callable[..., T], *, never: str, always: str, name: str) -> T:
    """Applies ``collective_matmul`` (or the layer's override) to layer ``name``:
    ``decide(mode, gradients_alone)`` for the mode it names.

    ``never`` and ``always`` are the layer kind's modes for those settings;
    ``auto`` lets the cost model pick. Under ``always`` a layer that cannot run
    that mode (``decide`` raises ValueError) gets ``auto``'s decision, whose
    reason says why it stays plain. A layer ``layer_overrides`` names runs as its form says
    whatever the setting, with a reason naming the pattern.
    """
    entry = self.override(name)
    form = entry[1] if entry else {'never': 'plain', 'always': 'ring'}.get(
        self.collective_matmul, 'auto')
    if form == 'plain':
      decision = decide(never, False)
    elif form == 'ring':
      try:
        decision = decide(always, False)
      except ValueError:
        decision = decide('auto', False)
    else:
      decision = decide('auto', form == 'gradients')
    if entry:
      decision = dataclasses.replace(
          decision, reason=f'parallelism.layer_overrides {entry[0]}={entry[1]}: ' +
          decision.reason)
    return decision


def parse_overrides(text: str) -> tuple[tuple[str, str], ...]:
  """``parallelism.layer_overrides`` ('PATTERN=FORM,...') as (pattern, form) pairs;
  ValueError naming the first bad entry."""
  pairs = []
  for entry in filter(None, (e.strip() for e in text.split(','))):
    pattern, eq, form = entry.partition('=')
    if not eq or not pattern.strip() or form.strip() not in LAYER_FORMS:
      raise ValueError(f'parallelism.layer_overrides: {entry!r} is not PATTERN=FORM with '
                       f'FORM one of {LAYER_FORMS}')
    pairs.append((pattern.strip(), form.strip()))
  return tuple(pairs)


class PlannedLayer(NamedTuple):
  """One layer of a plan: its decision, the PartitionSpecs and operand shapes it was made
  for."""
  decision: Any   # decision.Decision, or moe.ExchangeDecision for an MoE exchange
  specs: tuple    # (lhs, rhs, out); for an exchange (dispatched tokens, expert inputs)
  shapes: tuple = ()  # (lhs, rhs); for an exchange (dispatched tokens,)


class ShardedOps(Ops):
  """Ops that turn logical axes into shardings and dense layers into collective einsums.

  Every dense layer (and MoE exchange) runs as its entry in ``plan`` says
  (``plan_layers`` makes it before anything is jitted); without a plan every
  one runs as ``policy`` decides for the shapes it is traced with, and nothing
  is kept. Immutable: tracing a model changes nothing here, so the object is a
  faithful part of the model's static graph (hash and equality).
  """

  def __init__(self, mesh: jax.sharding.Mesh, rules: Rules,
               policy: MatmulPolicy = MatmulPolicy(collective_matmul='never'),
               plan: Mapping[str, PlannedLayer] | None = None):
    for key, value in (('mesh', mesh), ('rules', rules), ('policy', policy),
                       ('_plan', None if plan is None else dict(plan))):
      object.__setattr__(self, key, value)

  def __setattr__(self, key, value):
    raise AttributeError(f'ShardedOps is immutable (setting {key!r}); build another one')

  @property
  def plan(self) -> Mapping[str, PlannedLayer] | None:
    """Layer path -> PlannedLayer, read-only (None: decided by ``policy`` when traced)."""
    return None if self._plan is None else types.MappingProxyType(self._plan)

  def spec(self, axes: Axes) -> PartitionSpec:
    return logical_to_spec(axes, self.rules)

  def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
    sharding = NamedSharding(self.mesh, self.spec(axes))
    return jax.lax.with_sharding_constraint(x, sharding)

  def einsum(self, equation, x, w, *, x_axes, w_axes, out_axes, name, save_as=None,
             save_parts=None, position_wise=None):
    specs = tuple(self.spec(a) for a in (x_axes, w_axes, out_axes))
    decision = self._decision(name, specs, (x.shape, w.shape), lambda: self.policy.choose(
        lambda mode, alone: explain(
            equation, x.shape, w.shape, jnp.result_type(x.dtype, w.dtype), mesh=self.mesh,
            lhs_spec=specs[0], rhs_spec=specs[1], out_spec=specs[2], mode=mode,
            hardware=self.policy.hardware, ring_dtype=self.policy.ring_dtype,
            gradient_rings='any_forward' if alone else 'ringed_forward',
            prefer=dict(self.policy.prefer)),
        never='none', always='always', name=name))
    with jax.named_scope(name):  # names the layer's ops (and collectives) in HLO
      out = run_decision(decision, x, w, mesh=self.mesh, lhs_spec=specs[0],
                         rhs_spec=specs[1], out_spec=specs[2])
    self._declare(position_wise)
    return saved(out, save_as, save_parts if decision.mode != 'none' else None)

  def _declare(self, position_wise) -> None:
    """A position-wise chain the model declared (``Ops.einsum``): the plan keeps its ring
    order in the decisions (``_Planner``, ``decision.ring_order``); nothing to do here."""
    del position_wise

  def local(self, fn, *args, in_axes, out_axes):
    """``fn`` in a ``shard_map`` over the whole mesh, on the blocks the specs give."""
    in_specs = tuple(self.spec(a) for a in in_axes)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=self.spec(out_axes),
                         check_vma=False)(*args)

  def experts(self, x_becd, expert_fn, *, chunks, flops, weight_bytes, name):
    """The expert all-to-all, single or chunked as parallelism/moe.py decides.

    ``weight_bytes``: all experts' weights in the compute dtype; a device reads its
    share over the axes of ``exp`` and ``mlp`` (``embed`` is gathered over ``fsdp``).
    """
    dispatched, at_experts = self.spec(DISPATCHED), self.spec(AT_EXPERTS)
    split = math.prod(mesh_axis_size(self.mesh, e) for e in self.spec(('exp', 'mlp')))
    axis = at_experts[0] if isinstance(at_experts[0], str) else None
    if axis is not None and self.mesh.shape[axis] > 1:
      moe.check_layout(axis, dispatched, at_experts)
    decision = self._decision(name, (dispatched, at_experts), (x_becd.shape,),
                              lambda: self.policy.choose(
        lambda mode, _: moe.decide(x_becd.shape, x_becd.dtype.itemsize, flops, self.mesh, axis,
                                chunks, mode, self.policy.hardware, dispatched,
                                weight_bytes / split),
        never='single', always='chunked', name=name))
    with jax.named_scope(name):
      return moe.run(decision, x_becd, expert_fn, self.mesh, dispatched, at_experts)

  def _decision(self, name: str, specs: tuple, shapes: tuple,
                decide: Callable[[], Any]) -> Any:
    """Layer ``name``'s decision: the plan's, or (without a plan) ``decide()``'s."""
    if self._plan is None:
      return decide()
    if name not in self._plan:
      raise ValueError(f'layer {name!r} is not in the layer plan (it has {len(self._plan)} '
                       'layers): plan_layers traced another computation')
    planned = self._plan[name]
    if planned.specs != specs:
      raise ValueError(f'layer {name!r} runs with specs {specs}, planned with {planned.specs}')
    return planned.decision

  def __hash__(self):
    plan = None if self._plan is None else tuple(self._plan)
    return hash((self.mesh, self.rules, self.policy, plan))

  def __eq__(self, other):
    return (type(other) is type(self) and self.mesh == other.mesh
            and self.rules == other.rules and self.policy == other.policy
            and self._plan == other._plan)


class _Planner(ShardedOps):
  """Decides every layer as it is traced and keeps the decisions: ``plan_layers``'
  own tool, traced once and dropped, never part of a model that trains."""

  __hash__ = object.__hash__  # what it holds grows while it traces
  __eq__ = object.__eq__

  def __init__(self, *args, saved=None, **kwargs):
    super().__init__(*args, **kwargs)
    object.__setattr__(self, 'chains', set())  # every position_wise the model declared
    object.__setattr__(self, 'saved', saved)  # a plan file's layers (plan_file.read)
    object.__setattr__(self, 'shapes', {})  # each layer's operand shapes

  def _decision(self, name, specs, shapes, decide):
    self.shapes[name] = tuple(tuple(s) for s in shapes)
    if self.saved is None:
      decision = decide()
    else:  # the plan file's, where it was made for this layer as it is
      layer = self.saved['layers'].get(name)
      if layer is None:
        raise plan_file.PlanMismatch(f'layer {name!r} is not in the plan')
      for what, want, got in (('specs', layer.specs, specs),
                              ('operand shapes', layer.shapes, self.shapes[name])):
        if want != got:
          raise plan_file.PlanMismatch(f'layer {name!r} runs with {what} {got}, the plan '
                                       f'has {want}')
      decision = layer.decision
    self._plan[name] = PlannedLayer(decision, specs)
    return decision

  def _declare(self, position_wise):
    if position_wise is not None:
      self.chains.add(position_wise)


def _with_ring_order(plan: dict[str, PlannedLayer], chains) -> dict[str, PlannedLayer]:
  """``plan`` with each chain's producers keeping their results in ring order ('out') and
  its consumer its input ('lhs'; ``Decision.ring_order``), where every einsum of the chain
  is a ring over one axis that can keep ring order, forward and both gradients
  (``ring_order_fits``)."""
  plan = dict(plan)
  for producers, consumer in sorted(chains):
    ends = [(p, 'out') for p in producers] + [(consumer, 'lhs')]
    layers = [(plan.get(p), array) for p, array in ends]
    if (all(layer is not None for layer, _ in layers) and
        len({layer.decision.axis for layer, _ in layers}) == 1 and
        all(ring_order_fits(layer.decision, *layer.specs, array)
            for layer, array in layers)):
      plan.update({p: plan[p]._replace(decision=dataclasses.replace(
          plan[p].decision, ring_order=array)) for p, array in ends})
  return plan


def plan_layers(forward: Callable[[Ops], Any], *, mesh: jax.sharding.Mesh, rules: Rules,
                policy: MatmulPolicy, saved: dict | None = None,
                tune: Callable[[dict], dict] | None = None) -> dict[str, PlannedLayer]:
  """How every dense layer and MoE exchange of ``forward`` runs, decided before ``jit``.

  Args:
    forward: builds the model with the given Ops and applies it to inputs of
      the shapes the compiled step will see (a train step's microbatch), e.g.
      ``lambda ops: Transformer(cfg, nnx.Rngs(0), ops)(jnp.zeros((b, t), jnp.int32))``.
      It is traced abstractly (``jax.eval_shape``): nothing is computed.
    mesh, rules, policy: where the layers run and when they are decomposed.
    saved: a plan file's (``plan_file.read``): every layer runs as it says instead, where
      it was made for this model and mesh, else ``plan_file.PlanMismatch`` names the first
      mismatch.
    tune: maps the plan to the one that runs (``parallelism/tune.py``'s measurement)
      before the chains' ring orders are set; not with ``saved``.

  Returns:
    ``{layer path: PlannedLayer(decision, specs)}`` in the order the layers ran
    (a scanned stack's layers once, as ``blocks.*``). Give it to
    ``ShardedOps(mesh, rules, policy, plan)``: the model then runs exactly these
    decisions, and the parallelism report reads them.
  """
  wrong = saved and plan_file.mismatch(saved, mesh.shape, policy.hardware)  # made for both
  if wrong:
    what, planned, here = wrong
    raise plan_file.PlanMismatch(f"the plan is for {what} {planned!r}, this run's is {here!r}")
  planner = _Planner(mesh, rules, policy, plan={}, saved=saved)
  jax.eval_shape(lambda: forward(planner))
  missing = [n for n in (saved or {}).get('layers', {}) if n not in planner._plan]  # pylint: disable=protected-access
  if missing:
    raise plan_file.PlanMismatch(f'the plan has layer {missing[0]!r}, which this model has not')
  plan = {n: l._replace(shapes=planner.shapes[n]) for n, l in planner._plan.items()}  # pylint: disable=protected-access
  if saved is None:  # a saved plan has its ring orders
    plan = _with_ring_order(tune(plan) if tune else plan, planner.chains)
  unused = [p for p, _ in policy.layer_overrides
            if not any(fnmatch.fnmatchcase(n, p) for n in plan)]
  if unused:
    raise ValueError(f'parallelism.layer_overrides: {unused[0]!r} matches no layer (the '
                     f'layers: {", ".join(plan)})')
  return plan


def planned_ops(make_model: Callable[[Ops], Any], batch_shape: tuple[int, int], *,
                mesh: jax.sharding.Mesh, rules: Rules, policy: MatmulPolicy,
                saved: dict | None = None, tune: Callable[[dict], dict] | None = None
                ) -> ShardedOps:
  """ShardedOps running the plan of ``make_model(ops)`` applied to int32 tokens
  of ``batch_shape`` (``[batch, length]``, as the compiled step sees them), or ``saved``'s
  (``plan_layers``)."""
  plan = plan_layers(lambda ops: make_model(ops)(jnp.zeros(batch_shape, jnp.int32)),
                     mesh=mesh, rules=rules, policy=policy, saved=saved, tune=tune)
  return ShardedOps(mesh, rules, policy, plan)
