"""The training loop: abstract init, sharded state, compiled steps, metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from models.transformer import Transformer, count_params
from parallelism import hardware, mesh as mesh_lib, report, sharding
from trainer import checkpoint, data, metrics as metrics_lib, optim, pipeline, profiling
from trainer.step import TrainState, make_eval_step, make_train_step


class Stopped(Exception):
  """The run ended before ``steps``: preempted (SIGTERM) or a non-finite loss."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


@dataclasses.dataclass
class Program:
  """A run's train step and state, abstract: shapes and shardings, nothing allocated.

  What ahead-of-time compilation needs (``launch/aot.py``) and what setup()
  turns into a live run.
  """
  abstract_state: TrainState   # ShapeDtypeStructs carrying their NamedShardings
  state_sharding: Any
  batch_sharding: NamedSharding
  train_step: Any              # jitted (state, batch) -> (state, metrics); donates state
  init: Callable[[], TrainState]
  tx: Any
  schedule: Any
  ops: sharding.ShardedOps     # records every dense layer's decision when traced
  graphdef: Any
  abstract_params: Any

  def abstract_batch(self, batch_size: int, seq_len: int) -> dict:
    spec = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
    return {k: spec for k in ('inputs', 'targets', 'positions', 'segments')}


def build(cfg, model_cfg, mesh, rules) -> Program:
  """Builds the model and optimizer abstractly and jits the train step for ``mesh``."""
  ops = sharding.ShardedOps(mesh, rules, sharding.MatmulPolicy.from_config(cfg))
  make_model = lambda: Transformer(model_cfg, nnx.Rngs(cfg.seed), ops)
  graphdef, abstract_params = nnx.split(nnx.eval_shape(make_model))
  tx, schedule = optim.make_optimizer(cfg.optimizer, cfg.steps)

  def init() -> TrainState:
    params = nnx.state(make_model())
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

  abstract_state = jax.eval_shape(init)
  specs = sharding.state_specs(abstract_state, rules)
  sharding.check_divisible(abstract_params, specs.params, mesh)
  state_sharding = sharding.named(mesh, specs)
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_state, state_sharding)
  batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(('batch', 'length'), rules))
  train_step = jax.jit(
      make_train_step(graphdef, tx, cfg.optimizer.z_loss, cfg.optimizer.grad_accum_steps,
                      skip_nonfinite=cfg.on_nonfinite == 'skip'),
      in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
      donate_argnums=(0,))
  return Program(abstract_state, state_sharding, batch_sharding, train_step, init, tx,
                 schedule, ops, graphdef, abstract_params)


@dataclasses.dataclass
class Setup:
  """A run's sharded state, compiled-to-be steps and input functions."""
  state: TrainState
  start_step: int          # the step ``state`` is at (0, or the resumed checkpoint's)
  train_step: Any          # jitted (state, batch) -> (state, metrics); donates state
  eval_step: Any           # jitted (params, batch) -> sums
  get_batch: pipeline.TrainBatches  # get_batch(step): the global batch; prefetches the next
  eval_batches: list
  schedule: Any
  ops: sharding.ShardedOps
  graphdef: Any
  abstract_params: Any


def setup(run, checkpointer: checkpoint.Checkpointer | None = None) -> Setup:
  """Builds the program, creates, resumes or fine-tunes its state sharded; makes the inputs."""
  cfg = run.cfg
  p = build(cfg, run.model_cfg, run.mesh, run.rules)
  state, start_step = _initial_state(run, checkpointer, p)
  get_batch, eval_batches = pipeline.make(run.corpus, cfg, p.batch_sharding)
  if start_step:  # resumed: the data position the checkpoint recorded
    get_batch.seek(checkpointer.data_position(start_step))
  eval_step = jax.jit(make_eval_step(
      p.graphdef, data.BYTE_VOCAB if run.corpus.byte_level else None))
  return Setup(state, start_step, p.train_step, eval_step, get_batch, eval_batches,
               p.schedule, p.ops, p.graphdef, p.abstract_params)


def _initial_state(run, checkpointer, p: Program):
  """(state, step): resumed from the run's checkpoints, else fresh (params maybe loaded)."""
  log = print if jax.process_index() == 0 else (lambda *a, **k: None)
  # Every branch waits: one sharded computation in flight at a time (see train()).
  if checkpointer is not None and checkpointer.steps():
    state, step = checkpointer.restore(p.abstract_state)
    log(f'resuming from step {step} ({os.path.join(checkpointer.directory, str(step))})'
        + ('; init_from is ignored' if run.cfg.init_from else ''))
    return jax.block_until_ready(state), step
  if run.cfg.init_from:
    params = checkpoint.restore_params(run.cfg.init_from, p.abstract_state.params)
    log(f'parameters loaded from {run.cfg.init_from} (optimizer state and step start fresh)')
    fresh = lambda params: TrainState(jnp.zeros((), jnp.int32), params, p.tx.init(params))
    return jax.block_until_ready(jax.jit(fresh, out_shardings=p.state_sharding,
                                         donate_argnums=(0,))(params)), 0
  return jax.block_until_ready(jax.jit(p.init, out_shardings=p.state_sharding)()), 0


def train(run) -> dict:
  """Trains ``run`` (a validated trainer.train.Run); returns the last eval record.

  Raises Stopped when the run ends early (preemption, non-finite loss) after
  saving what can be saved.
  """
  cfg = run.cfg
  is_main = jax.process_index() == 0
  log = print if is_main else (lambda *a, **k: None)
  policy = checkpoint.Policy.from_config(cfg.checkpoint)
  ckpt = checkpoint.Checkpointer(run.workdir, policy)
  clock = metrics_lib.Stopwatch()  # where the wall time goes, from here on
  try:
    s = setup(run, ckpt)
    clock.lap('setup')
    train_step = s.train_step.lower(s.state, s.get_batch(s.start_step)).compile()
    compile_s = clock.lap('compile')
    profiling.dump_hlo(cfg, run.workdir, train_step, log)
    flops_tok, peak = _announce(run, s, compile_s, log, write_report=is_main)
    if is_main:
      metrics_lib.trim(run.workdir, s.start_step)
    clock.lap('setup')
    with _preemption_signal() as preempted:
      return _loop(run, s, train_step, ckpt, policy, preempted, (flops_tok, peak), log, clock)
  finally:
    ckpt.wait()
    ckpt.close()


def _loop(run, s: Setup, train_step, ckpt, policy, preempted, flops, log, clock) -> dict:
  cfg, mesh = run.cfg, run.mesh
  last_step = cfg.stop_after or cfg.steps
  writer = metrics_lib.MetricsWriter(run.workdir, last_step, s.start_step,
                                     enabled=jax.process_index() == 0, clock=clock)
  meta = checkpoint_meta(run)
  tokens_per_step = cfg.batch_size * cfg.seq_len
  state, window, eval_record, done = s.state, [], {}, s.start_step
  tracer = profiling.StepTracer(cfg, run.workdir, s.start_step, log)
  clock.lap('setup')  # opening the writers is not the first step's data wait
  try:
    for step in range(s.start_step, last_step):
      tracer.before(step)
      batch = s.get_batch(step)
      seconds = clock.lap('data_wait')
      state, out = train_step(state, batch)
      # Waiting for every step keeps at most one sharded step in flight: queuing
      # several has deadlocked XLA's CPU collectives with many fake devices.
      out = jax.device_get(out)
      seconds += clock.lap('device_step')
      tracer.after(step)
      window.append((out, seconds))
      done = step + 1
      _check_finite(out, done, cfg.on_nonfinite, ckpt)
      if done % cfg.log_every == 0 or done == last_step:
        writer.write(done, _train_record(window, s.schedule(step), tokens_per_step, *flops,
                                         mesh.size))
        window = []
      clock.lap('other')
      if (cfg.eval_every and done % cfg.eval_every == 0) or done == last_step:
        eval_record = _evaluate(s.eval_step, state.params, s.eval_batches)
        clock.lap('eval')
        writer.write(done, eval_record)
      stop = preempted()
      if policy.every and (done % policy.every == 0 or done == last_step or stop):
        ckpt.save(state, meta, data_position=s.get_batch.position())
        log(f'checkpoint {done}: saving to {ckpt.directory}'
            + (' in the background' if policy.async_save else ''))
      if stop:
        ckpt.wait()
        raise Stopped(f'stopped by SIGTERM after step {done}' + (
            '; checkpoint saved: run the same command to resume' if policy.every else
            '; checkpointing is off (checkpoint.every=0), nothing saved'), 143)
      clock.lap('checkpoint')  # the save above (and SIGTERM agreement); not step time
  finally:
    tracer.close()
    writer.write_summary(done)
    writer.close()
  if cfg.stop_after and cfg.stop_after < cfg.steps:
    log(f'stopped after step {cfg.stop_after} of {cfg.steps} (stop_after); ' + (
        'run the same command without stop_after to continue' if policy.every else
        'checkpointing is off (checkpoint.every=0): nothing was saved to continue from'))
  return eval_record


def checkpoint_meta(run) -> dict:
  """What a checkpoint records besides arrays: enough to check a restore."""
  return {'model': dataclasses.asdict(run.model_cfg), 'seed': run.cfg.seed,
          'mesh': mesh_lib.describe(run.mesh), 'processes': jax.process_count(),
          'config': json.loads(run.cfg.to_json()),
          'data': {'stream': pipeline.identity(run.corpus, run.cfg.batch_size, run.cfg.seq_len)}}


def _check_finite(out, step: int, on_nonfinite: str, ckpt) -> None:
  """Stops (or warns of a skipped update) before a non-finite state can be saved."""
  if bool(out['finite']):
    return
  loss, grad_norm = float(out['loss']), float(out['grad_norm'])
  what = (f'loss is {loss} (grad_norm {grad_norm})'
          if not (np.isfinite(loss) and np.isfinite(grad_norm)) else
          f'the update made parameters or optimizer state non-finite (loss {loss}, '
          f'grad_norm {grad_norm})')
  if on_nonfinite == 'skip':
    print(f'warning: step {step}: {what}; update skipped')
    return
  ckpt.wait()
  steps = ckpt.steps()
  kept = f'the last checkpoint (step {steps[-1]}) is intact' if steps else 'no checkpoint'
  raise Stopped(f'step {step}: {what}; stopped, {kept}; '
                '--config.on_nonfinite=skip drops such updates instead', 3)


@contextlib.contextmanager
def _preemption_signal():
  """Yields ``preempted()``: whether SIGTERM arrived (the loop then saves and stops).

  With several processes, SIGTERM reaches them at different moments; they
  agree (an all-gather of the flags, once per step) so that all save and stop
  after the same step.
  """
  received = []
  handler = lambda signum, frame: received.append(signum)
  if threading.current_thread() is not threading.main_thread():
    yield lambda: False
    return

  def preempted() -> bool:
    if jax.process_count() == 1:
      return bool(received)
    flags = multihost_utils.process_allgather(np.int32(bool(received)))
    return bool(np.max(flags))

  previous = signal.signal(signal.SIGTERM, handler)
  try:
    yield preempted
  finally:
    signal.signal(signal.SIGTERM, previous)


def _announce(run, s: Setup, compile_s: float, log, write_report: bool):
  """Prints what will run and writes the parallelism report; returns FLOP numbers."""
  cfg, mesh, ops = run.cfg, run.mesh, s.ops
  flops_tok = metrics_lib.flops_per_token(run.model_cfg, cfg.seq_len)
  peak, peak_source = hardware.peak_flops_per_device(
      cfg.hardware.name, cfg.hardware.peak_flops, mesh.size)
  log(f'data: {run.corpus.description}; {run.corpus.train_tokens:,} train / '
      f'{run.corpus.eval.num_tokens:,} held-out tokens')
  log(f'model: {count_params(s.abstract_params):,} parameters; mesh '
      f'{mesh_lib.describe(mesh)} ({jax.process_count()} process(es)); train step '
      f'compiled in {compile_s:.1f}s')
  log(f'{flops_tok / 1e6:.1f} MFLOP per token; peak {peak / 1e9:.2f} GFLOP/s per '
      f'device ({peak_source})')
  # Tracing the step recorded every dense layer's decision in `ops`.
  layer_rows = report.rows(ops.decisions)
  path = os.path.join(run.workdir, 'parallelism_report.json')
  log(report.summary(layer_rows, ops.policy, path))
  if write_report:
    report.write(path, layer_rows, ops.policy)
  return flops_tok, peak


def _train_record(window, lr, tokens_per_step, flops_tok, peak, num_devices) -> dict:
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
      **({'skipped': int(sum(o['skipped'] for o, _ in window))} if 'skipped' in window[0][0]
         else {}),
      **metrics_lib.device_memory(),
      # MoE: aux losses, dropped fraction and per-expert load, averaged over the window
      **{k: np.mean([o[k] for o, _ in window], axis=0).tolist()
         for k in window[0][0] if k.startswith('moe_')},
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
