"""The training loop: abstract init, sharded state, compiled steps, metrics."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from models.transformer import Transformer, count_params
from parallelism import hardware, mesh as mesh_lib, report, sharding
from trainer import data, metrics as metrics_lib, optim
from trainer.step import TrainState, make_eval_step, make_train_step


@dataclasses.dataclass
class Setup:
  """A run's sharded state, compiled-to-be steps and input functions."""
  state: TrainState
  train_step: Any          # jitted (state, batch) -> (state, metrics); donates state
  eval_step: Any           # jitted (params, batch) -> sums
  get_batch: Callable[[int], dict]
  eval_batches: list
  schedule: Any
  ops: sharding.ShardedOps
  graphdef: Any
  abstract_params: Any


def setup(run) -> Setup:
  """Builds state abstractly, creates it sharded, and jits the steps."""
  cfg, mesh, rules = run.cfg, run.mesh, run.rules
  # ---------------------------------------------------------------- model
  ops = sharding.ShardedOps(mesh, rules, sharding.MatmulPolicy.from_config(cfg))
  make_model = lambda: Transformer(run.model_cfg, nnx.Rngs(cfg.seed), ops)
  graphdef, abstract_params = nnx.split(nnx.eval_shape(make_model))
  tx, schedule = optim.make_optimizer(cfg.optimizer, cfg.steps)

  # ---------------------------------------------- abstract init, then sharded
  def init() -> TrainState:
    params = nnx.state(make_model())
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

  abstract_state = jax.eval_shape(init)
  specs = sharding.state_specs(abstract_state, rules)
  sharding.check_divisible(abstract_params, specs.params, mesh)
  state_sharding = sharding.named(mesh, specs)
  # Wait for it: one sharded computation in flight at a time (see train()).
  state = jax.block_until_ready(jax.jit(init, out_shardings=state_sharding)())

  # ----------------------------------------------------------- input data
  batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(('batch', 'length'), rules))
  rows = data.local_rows(batch_sharding, (cfg.batch_size, cfg.seq_len))
  get_batch = lambda step: data.to_global(
      data.train_rows(run.corpus, cfg.seed, step, cfg.batch_size, cfg.seq_len, rows),
      batch_sharding, cfg.batch_size)
  eval_batches = [data.to_global(
      data.eval_rows(run.corpus, i, cfg.batch_size, cfg.seq_len, rows),
      batch_sharding, cfg.batch_size) for i in range(cfg.eval_steps)]

  # ------------------------------------------------------------ the steps
  train_step = jax.jit(
      make_train_step(graphdef, tx, cfg.optimizer.z_loss, cfg.optimizer.grad_accum_steps),
      in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
      donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(
      graphdef, data.BYTE_VOCAB if run.corpus.byte_level else None))
  return Setup(state, train_step, eval_step, get_batch, eval_batches, schedule, ops,
               graphdef, abstract_params)


def train(run) -> dict:
  """Trains ``run`` (a validated trainer.train.Run); returns the last eval record."""
  cfg, mesh = run.cfg, run.mesh
  is_main = jax.process_index() == 0
  log = print if is_main else (lambda *a, **k: None)
  last_step = cfg.stop_after or cfg.steps
  s = setup(run)
  state, get_batch, schedule = s.state, s.get_batch, s.schedule
  start = time.perf_counter()
  train_step = s.train_step.lower(state, get_batch(0)).compile()
  flops_tok, peak = _announce(run, s, time.perf_counter() - start, log,
                              write_report=is_main)

  # ------------------------------------------------------------- the loop
  writer = metrics_lib.MetricsWriter(run.workdir, last_step, 0, enabled=is_main)
  tokens_per_step = cfg.batch_size * cfg.seq_len
  window, eval_record = [], {}
  tick = time.perf_counter()
  for step in range(last_step):
    state, out = train_step(state, get_batch(step))
    # Waiting for every step keeps at most one sharded step in flight: queuing
    # several has deadlocked XLA's CPU collectives with many fake devices.
    out = jax.device_get(out)
    window.append((out, time.perf_counter() - tick))
    done = step + 1
    if done % cfg.log_every == 0 or done == last_step:
      writer.write(done, _train_record(window, schedule(step), tokens_per_step,
                                       flops_tok, mesh.size, peak))
      window = []
    if (cfg.eval_every and done % cfg.eval_every == 0) or done == last_step:
      eval_record = _evaluate(s.eval_step, state.params, s.eval_batches)
      writer.write(done, eval_record)
    tick = time.perf_counter()  # logging and eval time is not step time
  writer.close()
  return eval_record


def _announce(run, s: Setup, compile_s: float, log, write_report: bool):
  """Prints what will run and writes the parallelism report; returns FLOP numbers."""
  cfg, mesh, ops = run.cfg, run.mesh, s.ops
  flops_tok = metrics_lib.flops_per_token(run.model_cfg, cfg.seq_len)
  peak, peak_source = hardware.peak_flops_per_device(
      cfg.hardware.name, cfg.hardware.peak_flops, mesh.size)
  log(f'data: {run.corpus.description}; {len(run.corpus.train):,} train / '
      f'{len(run.corpus.eval):,} held-out tokens')
  log(f'model: {count_params(s.abstract_params):,} parameters; mesh '
      f'{mesh_lib.describe(mesh)} ({jax.process_count()} process(es)); train step '
      f'compiled in {compile_s:.1f}s')
  log(f'{flops_tok / 1e6:.1f} MFLOP per token; peak {peak / 1e9:.2f} GFLOP/s per '
      f'device ({peak_source})')
  # Tracing the step recorded every dense layer's decision in `ops`.
  layer_rows = report.rows(ops.decisions)
  decomposed = sum(r['decision'] != 'none' for r in layer_rows)
  log(f'parallelism: collective_matmul={ops.policy.collective_matmul}, '
      f'{decomposed}/{len(layer_rows)} dense layers decomposed (step times modeled for '
      f'{ops.policy.hardware})\n{report.table(layer_rows)}')
  if write_report:
    report.write(os.path.join(run.workdir, 'parallelism_report.json'), layer_rows, ops.policy)
  return flops_tok, peak


def _train_record(window, lr, tokens_per_step, flops_tok, num_devices, peak) -> dict:
  seconds = sum(dt for _, dt in window) / len(window)
  tokens_per_sec = tokens_per_step / seconds
  flops_per_device = tokens_per_sec * flops_tok / num_devices
  return {
      'loss': float(np.mean([o['loss'] for o, _ in window])),
      'learning_rate': float(lr),
      'grad_norm': float(window[-1][0]['grad_norm']),
      'step_time': seconds,
      'tokens_per_sec': tokens_per_sec,
      'tflops_per_device': flops_per_device / 1e12,
      'mfu': flops_per_device / peak,
  }


def _evaluate(eval_step, params, batches) -> dict:
  sums = None
  for batch in batches:
    out = jax.device_get(eval_step(params, batch))
    sums = out if sums is None else {k: sums[k] + out[k] for k in sums}
  record = {'eval_loss': float(sums['nats'] / sums['tokens'])}
  if 'bytes' in sums:
    record['eval_bpb'] = float(sums['byte_nats'] / sums['bytes'] / np.log(2))
  return record
