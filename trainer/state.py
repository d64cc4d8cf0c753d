"""The model and its state built abstractly, once: shapes and dtypes, then shardings.

big_vision's order: ``nnx.eval_shape`` of the model (nothing allocated),
shardings from the logical axes every parameter names, then the state created
already sharded inside ``jit`` (trainer/loop.py). Training, its layout checks,
generation and launch.aot all build through here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx

from models.ops import Ops
from models.transformer import Transformer, TransformerConfig
from parallelism import sharding, tune
from trainer import validation
from trainer.config import Config


@dataclasses.dataclass(frozen=True)
class AbstractModel:
  """A Transformer as its graph and abstract parameters; ``create`` makes real ones."""
  cfg: TransformerConfig
  seed: int
  ops: Ops | None
  graphdef: nnx.GraphDef
  params: Any  # nnx.State of ShapeDtypeStructs

  def create(self) -> nnx.State:
    """Initialized parameters (inside ``jit``: created where their shardings say)."""
    return nnx.state(Transformer(self.cfg, nnx.Rngs(self.seed), self.ops))


def abstract_model(model_cfg: TransformerConfig, seed: int = 0,
                   ops: Ops | None = None) -> AbstractModel:
  """The model's graph and parameter shapes, nothing allocated."""
  make = lambda: Transformer(model_cfg, nnx.Rngs(seed), ops)
  graphdef, params = nnx.split(nnx.eval_shape(make))
  return AbstractModel(model_cfg, seed, ops, graphdef, params)


def with_shardings(abstract: Any, rules: sharding.Rules, mesh: jax.sharding.Mesh):
  """(``abstract`` whose leaves carry their NamedShardings, the shardings) on ``mesh``.

  ``abstract``: parameters or a whole TrainState. Raises ValueError naming every
  dimension that its mesh axes do not divide.
  """
  specs = sharding.state_specs(abstract, rules)
  sharding.check_divisible(abstract, specs, mesh)
  shardings = sharding.named(mesh, specs)
  placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  return placed, shardings


def model_for_mesh(cfg: Config, mesh: jax.sharding.Mesh, rules: sharding.Rules,
                   saved: dict | None = None, prefer: dict | None = None,
                   log=print) -> AbstractModel:
  """The run's model with the ops that shard it over ``mesh``: the layer plan
  (``parallelism.*`` decides which dense layers run as collective einsums), made
  for the microbatch the train step traces, or ``saved``'s (``plan_file.read``); ``prefer``:
  ring schedule settings every ring takes where they apply (``launch.aot --schedule``)."""
  model_cfg = cfg.transformer()
  # Planning traces the sharded model: first refuse, naming it, a dimension the mesh
  # does not divide (the batch, MoE capacity, parameters; shapes only).
  validation.check_layout(cfg, mesh.shape, abstract_model(model_cfg, cfg.seed).params)
  micro_bt = (cfg.batch_size // cfg.optimizer.grad_accum_steps, cfg.seq_len)
  policy = sharding.MatmulPolicy.from_config(cfg)
  if prefer:
    policy = dataclasses.replace(policy, prefer=tuple(prefer.items()))
  measure = cfg.parallelism.tune == 'measure' or (
      cfg.parallelism.tune == 'auto' and mesh.devices.flat[0].platform != 'cpu')
  tune_fn = functools.partial(tune.measure, dtype=model_cfg.dtype, mesh=mesh, policy=policy,
                              log=log) if measure else None
  ops = sharding.planned_ops(lambda ops: Transformer(model_cfg, nnx.Rngs(cfg.seed), ops),
                             micro_bt, mesh=mesh, rules=rules, policy=policy, saved=saved,
                             tune=tune_fn)
  return abstract_model(model_cfg, cfg.seed, ops)
