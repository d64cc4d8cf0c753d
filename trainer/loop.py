"""The training loop: abstract init, sharded state, compiled steps, metrics."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from models.transformer import count_params
from parallelism import hardware, mesh as mesh_lib, plan_file, report, sharding
from trainer import checkpoint, compression, data, metrics as metrics_lib, optim, pipeline
from trainer import profiling, runtime, tokenizer as tokenizer_lib
from trainer.config import Config
from trainer.state import AbstractModel, with_shardings
from trainer.step import TrainState, make_eval_step, make_train_step


class Stopped(Exception):
  """The run ended before ``steps``: a stop signal (SIGTERM, SIGINT, SIGHUP) or a non-finite
  loss; ``exit_code`` 128 + the signal's number, or 3."""

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
  ops: sharding.ShardedOps     # runs every dense layer as its plan (ops.plan) says
  graphdef: Any
  abstract_params: Any

  def abstract_batch(self, batch_size: int, seq_len: int) -> dict:
    spec = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=self.batch_sharding)
    return {k: spec for k in ('inputs', 'targets', 'positions', 'segments')}


def build(cfg: Config, model: AbstractModel, mesh, rules: sharding.Rules) -> Program:
  """Adds the optimizer to ``model`` (abstract, with its ops); jits the train step for ``mesh``."""
  tx, schedule = optim.make_optimizer(cfg.optimizer, cfg.steps)

  def init() -> TrainState:
    params = model.create()
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

  abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), model.params,
                        jax.eval_shape(tx.init, model.params))
  abstract_state, state_sharding = with_shardings(abstract, rules, mesh)
  batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(('batch', 'length'), rules))
  train_step = jax.jit(
      make_train_step(model.graphdef, tx, cfg.optimizer.z_loss, cfg.optimizer.grad_accum_steps,
                      skip_nonfinite=cfg.on_nonfinite == 'skip'),
      in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
      donate_argnums=(0,))
  return Program(abstract_state, state_sharding, batch_sharding, train_step, init, tx,
                 schedule, model.ops, model.graphdef, model.params)


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
  # gzip_bpb, xz_bpb: reference compressors on the bytes the evals score (byte-level data)
  eval_reference: dict = dataclasses.field(default_factory=dict)


def setup(run, checkpointer: checkpoint.Checkpointer | None = None) -> Setup:
  """Builds the program, creates, resumes or fine-tunes its state sharded; makes the inputs."""
  cfg = run.cfg
  p = build(cfg, run.model, run.mesh, run.rules)
  state, start_step = _initial_state(run, checkpointer, p)
  get_batch, eval_batches = pipeline.make(run.corpus, cfg, p.batch_sharding)
  if start_step:  # resumed: the data position the checkpoint recorded
    get_batch.seek(checkpointer.data_position(start_step))
  eval_step = jax.jit(make_eval_step(
      p.graphdef, data.BYTE_VOCAB if run.corpus.byte_level else None))
  reference = compression.reference(run.corpus, cfg.batch_size, cfg.seq_len, cfg.eval_steps)
  return Setup(state, start_step, p.train_step, eval_step, get_batch, eval_batches,
               p.schedule, p.ops, p.graphdef, p.abstract_params, reference)


def _initial_state(run, checkpointer, p: Program):
  """(state, step): resumed from the run's checkpoints, else fresh (params maybe loaded)."""
  log = print if jax.process_index() == 0 else (lambda *a, **k: None)
  # Every branch waits: one sharded computation in flight at a time (overlaps_steps).
  if checkpointer is not None and checkpointer.steps():
    state, step = checkpointer.restore(p.abstract_state)
    log(f'resuming from step {step} ({os.path.join(checkpointer.directory, str(step))})'
        + ('; init_from is ignored' if run.cfg.init_from else ''))
    change = optim.schedule_change(checkpoint.read_meta(checkpointer.directory, step).get(
        'config'), run.cfg.steps, run.cfg.optimizer, step)
    if change:
      log(change)
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

  Raises Stopped when the run ends early (a stop signal, a non-finite loss)
  after saving what can be saved, and checkpoint.SaveFailed when a save failed.
  The outputs of an earlier run in the workdir are replaced (or, resuming,
  trimmed to the checkpoint's step) only once this run's first steps have passed:
  at its first metrics record or checkpoint (see begin_outputs).
  """
  cfg = run.cfg
  is_main = jax.process_index() == 0
  log = print if is_main else (lambda *a, **k: None)
  policy = cfg.checkpoint
  ckpt = checkpoint.Checkpointer(run.workdir, policy)
  clock = metrics_lib.Stopwatch()  # where the wall time goes, from here on
  try:
    s = setup(run, ckpt)
    clock.lap('setup')
    train_step = s.train_step.lower(s.state, s.get_batch(s.start_step)).compile()
    compile_s = clock.lap('compile')
    profiling.dump_hlo(cfg.profile, run.workdir, train_step, log)
    flops_tok, peak, layer_rows = _announce(run, s, compile_s, log)
    begin = functools.partial(begin_outputs, run, s.start_step, layer_rows, s.ops.policy)
    clock.lap('setup')
    with runtime.stop_signals() as stops:
      try:
        return _loop(run, s, train_step, ckpt, policy, stops, (flops_tok, peak), log, clock,
                     begin)
      finally:  # a signal while the last save is written is still ours, not a kill
        ckpt.wait()
  finally:
    ckpt.wait()
    ckpt.close()


def begin_outputs(run, start_step: int, layer_rows: list, policy) -> None:
  """Process 0 starts this run's outputs: replaces an earlier run's (or trims them to
  ``start_step``, resuming), writes config.json and parallelism_report.json."""
  metrics_lib.begin(run.workdir, start_step)
  with open(os.path.join(run.workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(run.cfg.to_json(indent=2) + '\n')
  report.write(os.path.join(run.workdir, 'parallelism_report.json'), layer_rows, policy)
  plan_file.write(os.path.join(run.workdir, plan_file.NAME), plan_file.to_json(
      run.model.ops.plan, run.mesh.shape, run.cfg.hardware.name))


def _loop(run, s: Setup, train_step, ckpt, policy, stops, flops, log, clock, begin=None) -> dict:
  cfg = run.cfg
  last_step = cfg.stop_after or cfg.steps
  writer = metrics_lib.MetricsWriter(run.workdir, last_step, s.start_step,
                                     enabled=jax.process_index() == 0, clock=clock, begin=begin)
  meta = checkpoint_meta(run)
  tracer = profiling.StepTracer(cfg.profile, run.workdir, s.start_step, log)
  steps = _StepMetrics(cfg, s.schedule, flops, run.mesh.size, writer, ckpt, last_step)
  overlap = overlaps_steps(run.mesh)
  state, eval_record, done, finished = s.state, {}, s.start_step, False
  clock.lap('setup')  # opening the writers is not the first step's data wait
  try:
    for step in range(s.start_step, last_step):
      tracer.before(step)
      batch = s.get_batch(step)
      seconds = clock.lap('data_wait')
      state, out = train_step(state, batch)
      done = step + 1
      evaluate = (cfg.eval_every and done % cfg.eval_every == 0) or done == last_step
      periodic = policy.every and (done % policy.every == 0 or done == last_step)
      steps.dispatched(done, out)  # reads the previous step's metrics while this one runs
      if not overlap or evaluate or periodic or tracer.ends_with(step):
        steps.wait()  # this step's state is used next (or the CPU waits for every step)
      seconds += clock.lap('device_step')
      # Processes agree on a stop signal, or a failed save, where every step waits anyway
      # (CPU) or at log steps; a single process reads its own every step.
      stop = stops.check(ckpt, agree=not overlap or done % cfg.log_every == 0
                         or done == last_step)
      if stop:
        steps.wait()
      save = periodic or (stop and policy.every)
      steps.write(done, seconds)  # raises Stopped after a non-finite step
      tracer.after(step)
      clock.lap('other')
      if evaluate:
        eval_record = {**_evaluate(s.eval_step, state.params, s.eval_batches),
                       **s.eval_reference}
        clock.lap('eval')
        writer.write(done, eval_record)
      if save:
        writer.begin()  # a checkpoint of this run: its outputs are the workdir's now
        ckpt.save(state, meta, data_position=s.get_batch.position())
        log(f'checkpoint {done}: saving to {ckpt.directory}'
            + (' in the background' if policy.async_save else ''))
      if stop:
        ckpt.wait()
        raise Stopped(f'stopped by {signal.Signals(stop).name} after step {done}' + (
            '; checkpoint saved: run the same command to resume' if policy.every else
            '; checkpointing is off (checkpoint.every=0), nothing saved'), 128 + stop)
      clock.lap('checkpoint')  # the save above; not step time
    finished = True
  finally:
    tracer.close()
    if finished or writer.started:  # a run stopped before its first record replaces nothing
      writer.write_summary(steps.last_read or done)
    writer.close()
  if cfg.stop_after and cfg.stop_after < cfg.steps:
    log(f'stopped after step {cfg.stop_after} of {cfg.steps} (stop_after); ' + (
        'run the same command without stop_after to continue' if policy.every else
        'checkpointing is off (checkpoint.every=0): nothing was saved to continue from'))
  return eval_record


def overlaps_steps(mesh) -> bool:
  """Whether the loop keeps a step queued on the device while the host prepares the next.

  Not on a CPU mesh of several devices: queuing several sharded steps there has
  deadlocked XLA's CPU collectives with many fake devices, so the loop waits
  for every step (one CPU device has no collectives: it overlaps).
  """
  return mesh.devices.flat[0].platform != 'cpu' or mesh.size == 1


class _StepMetrics:
  """Each step's metrics, read to the host, checked, averaged into a record per log step.

  Reading a step's metrics waits for that step; ``dispatched`` reads a step's
  after the next one was dispatched, so that the device has it queued meanwhile.
  """

  def __init__(self, cfg, schedule, flops, num_devices, writer, ckpt, last_step):
    self.cfg, self.schedule, self.flops, self.num_devices = cfg, schedule, flops, num_devices
    self.writer, self.ckpt, self.last_step = writer, ckpt, last_step
    self.pending, self.ready, self.window, self.seconds = None, [], [], {}
    self.last_read = 0  # the last step whose metrics were read

  def dispatched(self, step: int, out) -> None:
    """Step ``step`` was dispatched: reads the step before it (waits for it)."""
    if self.pending:
      self.wait()
    self.pending = (step, out)

  def wait(self) -> None:
    """Reads the last dispatched step's metrics (waits for it)."""
    if self.pending:
      step, out = self.pending
      self.ready.append((step, _read(out)))
      self.pending = None

  def write(self, step: int, seconds: float) -> None:
    """Checks the steps read (Stopped on a non-finite one) and writes a record at log steps.

    ``seconds``: the wall time of the loop iteration that dispatched ``step``.
    """
    self.seconds[step] = seconds
    for k, out in self.ready:
      self.last_read = k
      _check_finite(out, k, self.cfg.on_nonfinite, self.ckpt)
      self.window.append((out, self.seconds.pop(k)))
      if k % self.cfg.log_every == 0 or k == self.last_step:
        self.writer.write(k, _train_record(self.window, self.schedule(k - 1),
                                           self.cfg.batch_size * self.cfg.seq_len,
                                           *self.flops, self.num_devices))
        self.window = []
    self.ready = []


def _read(out) -> dict:
  """A step's metrics on the host (waits for the step)."""
  return jax.device_get(out)


def checkpoint_meta(run) -> dict:
  """What a checkpoint records besides arrays: enough to check a restore."""
  return {'model': dataclasses.asdict(run.model_cfg), 'seed': run.cfg.seed,
          'mesh': mesh_lib.describe(run.mesh), 'processes': jax.process_count(),
          'config': run.cfg.to_dict(),
          'data': {'stream': pipeline.identity(run.corpus, run.cfg.batch_size, run.cfg.seq_len)},
          'tokenizer': tokenizer_identity(run.cfg.data.tokenizer, run.corpus.byte_level)}


def tokenizer_identity(spec: str, byte_level: bool) -> dict | None:
  """What the token ids of a run mean: ``{'name': 'bytes'}``, or a tokenizer file's name
  and SHA-256; None where unknown (token files or synthetic tokens, no data.tokenizer)."""
  if not spec:
    return {'name': 'bytes'} if byte_level else None
  path = tokenizer_lib.resolve(spec)
  return {'name': os.path.basename(path), 'sha256': data.file_sha256(path)}


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


def _announce(run, s: Setup, compile_s: float, log):
  """Prints what will run; returns FLOP numbers and the parallelism report's rows."""
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
  layer_rows = report.rows(ops.plan)
  path = os.path.join(run.workdir, 'parallelism_report.json')
  log(report.summary(layer_rows, ops.policy, path))
  return flops_tok, peak, layer_rows


def _train_record(window, lr, tokens_per_step, flops_tok, peak, num_devices) -> dict:
  """A log record: means over ``window``, the steps' (host metrics, seconds) since the last."""
  seconds = sum(dt for _, dt in window) / len(window)
  tokens_per_sec = tokens_per_step / seconds
  flops_per_device = tokens_per_sec * flops_tok / num_devices
  outs = [o for o, _ in window]
  return {
      'loss': float(np.mean([o['loss'] for o in outs])),
      'learning_rate': float(lr),
      'grad_norm': float(outs[-1]['grad_norm']),
      'step_time': seconds,
      'tokens_per_sec': tokens_per_sec,
      'tflops_per_device': flops_per_device / 1e12,
      'mfu': flops_per_device / peak,
      **({'skipped': int(sum(o['skipped'] for o in outs))} if 'skipped' in outs[0] else {}),
      **metrics_lib.device_memory(),
      # MoE: aux losses, dropped fraction and per-expert load, averaged over the window
      **{k: np.mean([o[k] for o in outs], axis=0).tolist()
         for k in outs[0] if k.startswith('moe_')},
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
