"""Profiling a run: a ``jax.profiler`` trace of chosen steps, the train step's HLO.

``profile.num_steps > 0`` traces the updates ``profile.start_step`` ..
``start_step + num_steps - 1`` (numbered from 0 like the loop: update k is the
one metrics.jsonl records as step k + 1) into ``WORKDIR/profile/``:
``plugins/profile/<time>/<host>.xplane.pb`` for TensorBoard's profile plugin
(XProf) and ``perfetto_trace.json.gz`` beside it for ui.perfetto.dev. The loop
waits for the last traced step before the trace stops (``ends_with``); where it
keeps a step queued (accelerators, trainer/loop.py), the end of the step before
the first may show too.
``profile.dump_hlo`` writes the compiled (optimized, scheduled) HLO of the
train step to ``WORKDIR/profile/train_step.hlo.txt``.
"""

from __future__ import annotations

import os

import jax

from trainer.config import Profile

SUBDIR = 'profile'


def dump_hlo(cfg: Profile, workdir: str, compiled, log) -> None:
  """Writes ``compiled.as_text()`` when ``profile.dump_hlo`` is set (process 0)."""
  if not cfg.dump_hlo or jax.process_index() != 0:
    return
  path = os.path.join(workdir, SUBDIR, 'train_step.hlo.txt')
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(compiled.as_text())
  log(f'profile: optimized HLO of the train step written to {path}')


class StepTracer:
  """Starts the trace before update ``start_step`` and stops it after the last one."""

  def __init__(self, cfg: Profile, workdir: str, first_step: int, log):
    self.start, num_steps = cfg.start_step, max(cfg.num_steps, 0)
    self.stop_after = self.start + num_steps
    self.directory, self.log, self.active = os.path.join(workdir, SUBDIR), log, False
    if num_steps and first_step > self.start:
      log(f'profile: this run starts at step {first_step}, after profile.start_step='
          f'{self.start}; nothing is traced')

  def before(self, step: int) -> None:
    if step == self.start and self.stop_after > self.start:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active = True

  def ends_with(self, step: int) -> bool:
    """Whether the trace stops after update ``step`` (the loop waits for it first)."""
    return self.active and step + 1 >= self.stop_after

  def after(self, step: int) -> None:
    if self.ends_with(step):
      self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      self.log(f'profile: trace of steps {self.start}..{self.stop_after - 1} written to '
               f'{self.directory} (tensorboard --logdir {self.directory}, or '
               'perfetto_trace.json.gz in ui.perfetto.dev)')
