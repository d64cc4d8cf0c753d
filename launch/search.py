r"""Layout search for a TPU slice: ``python -m launch.aot --config X --search``.

Sweeps a bounded grid of layouts for the config's model on the slice:

* mesh sizes ``data x fsdp x tensor`` covering the chips (tensor and data
  powers of two, tensor at most 16, data at most 8);
* tokens per chip: the config's batch, half and twice it;
* remat: ``full``, ``save_dot_except_mlp``, ``save_dot_except_qkv`` and ``minimal``.

Candidates the slice cannot lay out (each mesh size a product of its physical
axes) or the layout checks refuse (divisibility, as the trainer checks) are
dropped; the rest get an **estimate** of their memory per chip (below) and are
dropped when it is more than ``ESTIMATE_MARGIN`` (5%, the estimate's largest known
overestimate) above the chip's usable HBM. The survivors are ranked by an
analytical MFU (``modeled_mfu``: matmul time at peak with remat's recompute,
overlapped with the FSDP weight gathers, plus what the compiler leaves exposed:
the gradients' reduce-scatter, tensor-parallel activation transfers and the
data-parallel all-reduce) and the best ``--max_compiles`` are compiled, each
variant in its own process as ``launch.aot`` does (a 500B search with the
defaults, 18 compiles, took about 15 minutes on a 2-core machine). Prints
progress, then one table (layout, estimated and compiled GiB per chip, fit,
modeled MFU of each variant; each variant's own memory where the variants' differ) and
the best layout per variant among those where that variant's program fits. Everything but
the compiler's memory figures is modeled. ``--refine`` compiles the config's own layout
under each combination of the program settings the grid leaves alone (``knob_grid``) and
prints the same table.
``--max_compiles 0`` compiles nothing (and needs no libtpu): it prints every
surviving layout in rank order with its estimates, to choose how many to compile.

Memory estimate per chip (bytes): parameters with AdamW moments and the
gradient, ``14 N / (fsdp x tensor)`` in bf16 compute (the layers' gradients stay bf16
until the optimizer, ``models.ops.weight``; the embeddings' are fp32, 2 bytes more each;
``2 N`` less for each moment in bfloat16; ``4 N`` more for the accumulated gradient
with ``optimizer.grad_accum_steps`` above 1);
saved activations, per layer and per token of a model-parallel group's microbatch
(``batch / (data x fsdp x grad_accum_steps)`` sequences: the step scans the
microbatches), ``2 d / tensor`` under ``full`` (the block's
input, sequence-parallel), ``2 (2 d + q + k + v) / tensor`` under
``save_dot_except_mlp`` (with the q/k/v projections and the output projection's
sequence-parallel output), ``2 (2 d + 2 mlp) / tensor`` under
``save_dot_except_qkv`` (the output projection's and gate/up's outputs) and
``2 (q + k + v + o + 2 mlp + d) / tensor`` under ``minimal`` (the projections'
outputs); one layer's working set, four times
the larger of its MLP and attention activations; the fp32 attention logits of one
layer, ``3 x 4 heads/tensor x seq x keys`` per sequence, with ``keys`` the sequence
under ``model.attention='xla'``, one block under ``blockwise`` and none under a fused
kernel (``splash``, which ``auto`` picks on a TPU, never holds them in HBM); the
unembedding's fp32 logits, ``3 x 4 vocab / tensor`` per token; and FSDP's unsharded
layer, ``FSDP_LAYER_BYTES`` (10) per parameter of one layer over ``tensor``: its bf16
weights gathered twice (the layer computing and the next one's gather) and its gradient
before the reduce-scatter in bf16 and fp32. Against compiled totals on v4 (GiB per chip,
estimate / compiled): 500B fsdp=128 x tensor=8 at 256 sequences, ``save_dot_except_qkv``
28.9 / 28.10, ``minimal`` 31.3 / 29.98 (ours). That ``minimal`` estimate is above the
usable 30.75 but within the margin, so the search keeps that layout (before the margin it
skipped it, though it fits). The grid does not sweep what ``configs/dense_500b.py`` adds to that
``minimal`` layout (two layers a scan iteration, the casts in the scan, and its plan
file's weight-gradient rings: 30.74 compiled, 8.017 s); ``--refine`` (``refine``) compiles
a layout under every combination of the first two and finds them best for every variant
there, ``--tune`` ours' plan. Before the layers' gradients stayed bf16 (2 bytes a layer parameter
less, estimated and compiled): 500B 29.8 / 29.54 and 32.2 / 31.3; 64B data=8 x fsdp=64 at
1,024 sequences, ``full``, 29.6 / 32.58 (25.8, 28.1 and 26.7 when the estimate charged the
whole attention logits whatever the kernel and had neither of the last two terms). That
64B layout (no tensor axis) is short by two errors of opposite sign: at 512 sequences it
compiled to 30.42 (baseline), 2.16 GiB less, where the estimate fell 3.65 (its per-token
terms run 1.7x high there), so the rest is about 6 GiB short (not traced to a buffer
yet); doubling the vocabulary added 1.09 GiB compiled, 1.63 estimated. An estimate short
of the compiled total costs a compile that then reports DOES NOT FIT; one above it drops
a layout that fits, so the terms are not refitted to one layout alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
import time

import jax.numpy as jnp

from models import attention
from models.transformer import count_params
from parallelism import decision, hardware, pricing, schedule
from trainer import metrics, optim, validation
from trainer.state import abstract_model


@dataclasses.dataclass(frozen=True)
class Layout:
  data: int
  fsdp: int
  tensor: int
  batch_size: int
  remat: str

  @property
  def overrides(self) -> list[str]:
    return [f'--config.mesh.data={self.data}', f'--config.mesh.fsdp={self.fsdp}',
            f'--config.mesh.tensor={self.tensor}', f'--config.batch_size={self.batch_size}',
            f'--config.model.remat={self.remat}', '--config.mesh.expert=1', PLAN_ANEW]

  def __str__(self) -> str:
    return (f'data={self.data} fsdp={self.fsdp} tensor={self.tensor} '
            f'batch={self.batch_size} remat={self.remat}')


# The override that plans ours anew, not from the config's plan file: a plan is one
# layout's and one program's (configs/plans/README.md).
PLAN_ANEW = '--config.parallelism.plan='

REMATS = ('full', 'save_dot_except_mlp', 'save_dot_except_qkv', 'minimal')


@dataclasses.dataclass(frozen=True)
class Knobs:
  """Program settings ``--refine`` sweeps at one layout (the grid above does not)."""
  scan_unroll: int
  cast_in_loop: bool

  @property
  def changes(self) -> dict:
    return {'model.scan_unroll': self.scan_unroll, 'model.cast_in_loop': self.cast_in_loop}

  @property
  def overrides(self) -> list[str]:
    return [f'--config.{key}={value}' for key, value in self.changes.items()]

  def __str__(self) -> str:
    return ' '.join(f'{key.split(".")[-1]}={value}' for key, value in self.changes.items())


def knob_grid(cfg) -> list[Knobs]:
  """Every combination ``--refine`` tries: one or two layers per scan iteration (with
  ``model.scan_layers``) and the weights' casts outside or inside the scan (ours' ring
  schedules, the weight-gradient rings among them, are ``--tune``'s)."""
  unrolls = [1, 2] if cfg.model.scan_layers else [1]
  return [Knobs(*k) for k in itertools.product(unrolls, (False, True))]


def grid(cfg, chips: int) -> list[Layout]:
  """Every layout of the bounded grid for ``chips`` (unchecked)."""
  powers = [2 ** i for i in range(int(math.log2(chips)) + 1)]
  batches = sorted({max(1, int(cfg.batch_size * f)) for f in (0.5, 1, 2)})
  out = []
  for tensor, data in itertools.product([p for p in powers if p <= 16],
                                        [p for p in powers if p <= 8]):
    if chips % (tensor * data):
      continue
    for batch, remat in itertools.product(batches, REMATS):
      out.append(Layout(data, chips // (tensor * data), tensor, batch, remat))
  return out


# How far above the usable HBM an estimate may be and its layout still compiled: the
# estimate's largest overestimate against a compiled total (500B ``minimal``: 31.3 / 29.98
# GiB, 4.4%; the module docstring). A layout within it that does not fit costs one compile,
# which then reports DOES NOT FIT; without it, that 500B layout was skipped though it fits.
ESTIMATE_MARGIN = 0.05

# Bytes per parameter of one layer, per tensor shard, that FSDP holds unsharded at once:
# the layer's bf16 weights gathered twice (the layer computing and the next one's gather
# in flight: 4) and its weight gradient before the reduce-scatter, as computed (bf16: 2)
# and in the parameters' fp32 (4). The module docstring compares the estimate with
# compiled totals; tests/test_aot.py pins one of them.
FSDP_LAYER_BYTES = 10


def attention_keys(model_cfg, seq_len: int) -> int:
  """Key positions of the fp32 attention logits held per query (on a TPU): the whole
  sequence for ``xla``, one block for ``blockwise``, none in HBM for a fused kernel
  (``splash``, ``cudnn``; ``auto`` is splash on a TPU where it can run)."""
  m = model_cfg
  kind = m.attention
  if kind == 'auto':
    kind = attention.choose('auto', 'tpu', m.dtype, m.head_dim, seq_len, m.attention_block)
  return {'xla': seq_len, 'blockwise': min(m.attention_block, seq_len)}.get(kind, 0)


def memory_estimate(model_cfg, params: int, layout: Layout, seq_len: int,
                    mu_bytes: int = 4, accum_steps: int = 1, nu_bytes: int = 4) -> float:
  """Bytes per chip (the module docstring's formula; an estimate, not the compiler's)."""
  m, t = model_cfg, layout.tensor
  shards = layout.fsdp * t
  embeddings = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
  # fp32 weights, the two moments, and the gradient: the layers' in
  # the compute dtype until the optimizer reads it (models.ops.weight; fp32 with
  # model.grads_in_param_dtype), the embeddings' in fp32
  layer_grad = 4 if m.grads_in_param_dtype else jnp.dtype(m.dtype).itemsize
  grads = layer_grad * (params - embeddings) + 4 * embeddings
  state = ((4 + mu_bytes + nu_bytes + (4 if accum_steps > 1 else 0)) * params + grads) / shards
  # Per microbatch: the step scans ``accum_steps`` of them (trainer/step.py).
  seqs = layout.batch_size / (layout.data * layout.fsdp) / accum_steps
  tokens = seqs * seq_len
  heads = m.num_heads * m.head_dim
  kv = m.num_kv_heads * m.head_dim
  per_token = 2 * {'full': m.d_model,
                   'save_dot_except_mlp': 2 * m.d_model + heads + 2 * kv,
                   'save_dot_except_qkv': 2 * m.d_model + 2 * m.mlp_dim,
                   'minimal': 2 * heads + 2 * kv + 2 * m.mlp_dim + m.d_model}[layout.remat] / t
  working = 4 * 2 * tokens * max(m.mlp_dim, heads + 2 * kv) / t
  logits = 3 * 4 * (m.num_heads / t) * seq_len * attention_keys(m, seq_len) * seqs
  unembed = 3 * 4 * tokens * m.vocab_size / t
  layer = FSDP_LAYER_BYTES * (params - embeddings) / m.num_layers / t
  return state + m.num_layers * tokens * per_token + working + logits + unembed + layer


def recompute_factor(model_cfg, remat: str) -> float:
  """Matmul FLOPs per step over the model's 6N: ``full`` repeats every forward
  projection (4/3), ``save_dot_except_mlp`` only the MLP's, ``save_dot_except_qkv``
  only q/k/v's, ``minimal`` little."""
  m = model_cfg
  qkv = m.d_model * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
  attn = qkv + m.d_model * m.num_heads * m.head_dim
  mlp = 3 * m.d_model * m.mlp_dim
  return {'full': 4 / 3, 'save_dot_except_mlp': 1 + mlp / (attn + mlp) / 3,
          'save_dot_except_qkv': 1 + qkv / (attn + mlp) / 3, 'minimal': 1.05}[remat]


def assignable(sizes, physical) -> bool:
  """Whether every mesh axis of ``sizes`` (in mesh order) is the product of some of the
  slice's ``physical`` axes not yet taken, as JAX builds a TPU device mesh (physical axes
  are not split)."""
  left = list(physical)
  for size in (s for s in sizes if s > 1):
    pick = next((c for r in range(1, len(left) + 1)
                 for c in itertools.combinations(range(len(left)), r)
                 if math.prod(left[i] for i in c) == size), None)
    if pick is None:
      return False
    left = [d for i, d in enumerate(left) if i not in pick]
  return True


# Tensor-parallel transfers per layer that remat's recomputed forward repeats: a gather and
# a reduce-scatter for each part of the block (attention, MLP) it recomputes projections of.
# An upper bound: a recomputed part's reduce-scatter repeats only where its output is needed.
# Every layout also has 8: forward, an all-gather before q/k/v and gate/up and a
# reduce-scatter after the output and down projections; backward, their transposes.
REMAT_TRANSFERS = {'full': 4, 'save_dot_except_mlp': 2, 'save_dot_except_qkv': 2, 'minimal': 0}


def modeled_mfu(model_cfg, params: int, model_flops: float, layout: Layout, chips: int,
                seq_len: int, profile: hardware.HardwareProfile) -> float:
  """An analytical MFU to rank candidates, the baseline's: matmuls at peak with remat's
  recompute, overlapped with the FSDP weight gathers (bf16 weights, three passes), plus
  what the compiler leaves exposed: the gradients' reduce-scatter over ``fsdp``
  (synchronous), the tensor-parallel activation transfers (``8 + REMAT_TRANSFERS`` per
  layer, not overlapped) and the data-parallel all-reduce; each collective one ring over
  its mesh axis."""
  m = model_cfg
  compute = model_flops * recompute_factor(m, layout.remat) / (chips * profile.peak_flops)
  ring = lambda moved, n: pricing.ring_collective_seconds(
      moved, [n], profile.link_bandwidth, profile.ring_links, profile.step_latency)
  weights = 2 * params / layout.tensor  # bf16, one model-parallel group's
  tokens = layout.batch_size * seq_len / (layout.data * layout.fsdp)
  activations = m.num_layers * tokens * m.d_model * 2
  exposed = (ring(weights, layout.fsdp) + ring(2 * weights / layout.fsdp, layout.data) +
             ring((8 + REMAT_TRANSFERS[layout.remat]) * activations, layout.tensor))
  return model_flops / (chips * profile.peak_flops) / (
      max(compute, ring(3 * weights, layout.fsdp)) + exposed)


def candidates(cfg, chips: int, profile, progress=print,
               physical=None) -> list[tuple[Layout, float, float]]:
  """(layout, estimated bytes per chip, analytical MFU) of the layouts worth compiling,
  best first; with ``physical`` (the slice's axes, e.g. ``(4, 4, 8)``), only layouts the
  slice can lay out."""
  params = abstract_model(cfg.transformer()).params  # the same shapes in every layout
  n = count_params(params)
  kept = []
  for layout in grid(cfg, chips):
    if physical and not assignable((layout.data, layout.fsdp, layout.tensor), physical):
      progress(f'  skip {layout}: the slice {"x".join(map(str, physical))} cannot lay out '
               'these mesh sizes (each must be a product of its axes)')
      continue
    trial = cfg.replace({'mesh.data': layout.data, 'mesh.fsdp': layout.fsdp,
                         'mesh.tensor': layout.tensor, 'mesh.expert': 1,
                         'batch_size': layout.batch_size, 'model.remat': layout.remat})
    mesh_shape = {'data': layout.data, 'fsdp': layout.fsdp, 'tensor': layout.tensor,
                  'expert': 1}
    try:
      trial.validate()
      validation.check_layout(trial, mesh_shape, params)
    except ValueError as e:
      progress(f'  skip {layout}: {str(e).splitlines()[0]}')
      continue
    model_cfg = trial.transformer()
    estimate = memory_estimate(model_cfg, n, layout, cfg.seq_len,
                               mu_bytes=optim.moment_bytes(cfg.optimizer.mu_dtype),
                               nu_bytes=optim.moment_bytes(cfg.optimizer.nu_dtype),
                               accum_steps=cfg.optimizer.grad_accum_steps)
    if estimate > profile.usable_hbm_bytes * (1 + ESTIMATE_MARGIN):
      progress(f'  skip {layout}: estimated {estimate / 2**30:.1f} GiB per chip > '
               f'{profile.usable_hbm_bytes / 2**30:.2f} usable + {ESTIMATE_MARGIN:.0%} '
               "(the estimate's margin)")
      continue
    flops = metrics.flops_per_token(model_cfg, cfg.seq_len) * layout.batch_size * cfg.seq_len
    kept.append((layout, estimate, modeled_mfu(model_cfg, n, flops, layout, chips,
                                               cfg.seq_len, profile)))
  return sorted(kept, key=lambda c: (-round(c[2], 3), -c[0].batch_size / c[0].data))


def run(args, overrides, cfg, topology: str, profile, physical: tuple[int, ...],
        variants: list[str], compile_layout) -> int:
  """The search on the slice of axes ``physical``: prune, compile the best
  ``args.max_compiles``, print the table."""
  compile_ranked(args.max_compiles, cfg, topology, profile, physical, variants,
                 compile_layout)
  return 0


def compile_ranked(max_compiles: int, cfg, topology: str, profile, physical: tuple[int, ...],
                   variants: list[str], compile_layout) -> list:
  """Ranks the layouts (``candidates``) and compiles the best ``max_compiles``, with
  progress, and prints their table (0: prints the ranking and compiles none); the rows."""
  progress = lambda msg: print(msg, file=sys.stderr, flush=True)
  chips = math.prod(physical)
  progress(f'search on {topology} ({chips} chips): {len(grid(cfg, chips))} layouts in the grid')
  kept = candidates(cfg, chips, profile, progress, physical=physical)
  passed = f'{len(kept)} pass the checks and the memory estimate'
  if not max_compiles:
    progress(f'{passed}; compiling none')
    print(ranking(kept, profile.usable_hbm_bytes))
    return []
  chosen = kept[:max_compiles]
  progress(f'{passed}; compiling the best {len(chosen)} by analytical MFU, '
           f'{len(variants)} variant(s) each')
  rows, start = [], time.perf_counter()
  for i, (layout, estimate, mfu) in enumerate(chosen):
    progress(f'[{i + 1}/{len(chosen)}] {layout} (estimated {estimate / 2**30:.1f} GiB, '
             f'analytical MFU {mfu:.1%})')
    summary = compile_layout(layout.overrides)
    rows.append((layout, estimate, mfu, summary))
  progress(f'compiled {len(chosen)} layout(s) x {len(variants)} variant(s) in '
           f'{time.perf_counter() - start:.0f} s')
  print(table(rows, variants))
  return rows


def best_layout(max_compiles: int, cfg, topology: str, profile, physical: tuple[int, ...],
                compile_layout) -> Layout | None:
  """``--tune --search``'s first half: the layout search for ours alone (its table
  printed); the layout whose compiled program fits with the highest modeled MFU, or None."""
  best = best_row(compile_ranked(max_compiles, cfg, topology, profile, physical, ['ours'],
                                 compile_layout), 'ours')
  return best and best[0]


def refine(cfg, variants, compile_layout) -> int:
  """``--refine``: compiles the config's layout under every ``knob_grid`` combination
  (each valid one; a combination the model refuses is skipped with its reason) and prints
  the table, the best combination per variant among those where its program fits. Ours
  runs the config's plan file at the config's own settings and is planned anew at the
  others (a plan is one program's)."""
  progress = lambda msg: print(msg, file=sys.stderr, flush=True)
  grid_ = knob_grid(cfg)
  own = Knobs(cfg.model.scan_unroll, cfg.model.cast_in_loop)
  anew = lambda knobs: [] if knobs == own else [PLAN_ANEW]
  chosen = []
  for knobs in grid_:
    try:
      cfg.replace(knobs.changes).validate()
      chosen.append(knobs)
    except ValueError as e:
      progress(f'  skip {knobs}: {str(e).splitlines()[0]}')
  progress(f'refine at the config\'s layout: {len(chosen)} of {len(grid_)} settings, '
           f'{len(variants)} variant(s) each')
  rows, compiles, start = [], 0, time.perf_counter()
  for i, knobs in enumerate(chosen):
    progress(f'[{i + 1}/{len(chosen)}] {knobs}')
    rows.append((knobs, None, None, compile_layout(knobs.overrides + anew(knobs), variants)))
    compiles += len(variants)
  progress(f'compiled {len(chosen)} setting(s), {compiles} program(s), in '
           f'{time.perf_counter() - start:.0f} s')
  print(table(rows, variants, what='setting'))
  return 0


def schedule_grid(mesh_shape: dict) -> list[dict]:
  """``--tune``'s candidates, as ``prefer`` settings every ring of ours takes where they
  apply: the planner's own (``{}``), each choice of weight-gradient rings
  (``schedule.ACCUMULATORS``), each schedule field at each of its values
  (``schedule.CHOICES``) and the ring steps per loop iteration at 1, 2 and the longest ring
  (no loop). One field at a time, so a table row says what its change did; those that
  leave the plan as it was (the planner's own value) are dropped by ``plan_key``."""
  longest = max([n for n in mesh_shape.values()] + [1])
  return ([{}] + [{'accumulators': value} for value in schedule.ACCUMULATORS]
          + [{key: value} for key, values in schedule.CHOICES.items() for value in values]
          + [{'unroll': n} for n in sorted({1, 2, longest})])


def schedule_label(prefer: dict) -> str:
  return ' '.join(f'{k}={v}' for k, v in prefer.items()) or "the planner's"


def plan_key(plan: dict) -> str:
  """What of a plan (``plan_file.to_json``) decides the compiled program, as a string:
  equal for two candidates that compile the same."""
  def strip(x):
    if isinstance(x, dict):
      return {k: strip(v) for k, v in x.items() if k not in decision.EXPLAINING}
    return [strip(v) for v in x] if isinstance(x, list) else x
  return json.dumps(strip(plan['layers']), sort_keys=True)


# ``--tune`` starts another round only from a program that models at least this much faster
# than the one its round started from: smaller modeled gains are far inside the step model's
# error (its band), not worth a round of compiles (v4 moe_1t: pairs joined 0.03% faster).
ROUND_MIN_GAIN = 0.005


def neighbours(prefer: dict, mesh_shape: dict) -> list[dict]:
  """The candidates one schedule field away from ``prefer`` (``schedule_grid``'s changes,
  each set over it), those that change it."""
  out = []
  for change in schedule_grid(mesh_shape)[1:]:
    p = {**prefer, **change}
    if p != prefer and p not in out:
      out.append(p)
  return out


def tune(mesh_shape: dict, max_compiles: int, plan_all, compile_one, write_plan,
         plan_out: str, where: str = "the config's layout", start: dict | None = None) -> int:
  """``--tune``: a greedy search over ring schedules on compiled programs. Round 1 plans
  every ``schedule_grid`` candidate (or, from ``start``, that schedule and each one-field
  change of it; ``plan_all``: their plan files, or an error line) and compiles its distinct
  plans (``compile_one``: a summary with its ``plan``, or an error line); while compiles are
  left of ``max_compiles`` and a round's fastest program models ``ROUND_MIN_GAIN`` faster
  than the one it started from, the next round compiles each one-field change of that one
  (``neighbours``; plans compiled before are skipped). Prints the table and the fastest
  modeled program that fits (of equals the first: the planner's before a change), and
  writes its plan (``write_plan``: the command that trains with it). ``where``: the layout,
  for the progress lines. Exit status 1 where nothing compiled fits."""
  progress = lambda msg: print(msg, file=sys.stderr, flush=True)
  rows, prefers, seen, left_out = [], {}, {}, []
  center, grid_ = (start, [start] + neighbours(start, mesh_shape)) if start else (
      None, schedule_grid(mesh_shape))
  budget, began = max_compiles, time.perf_counter()
  for round_ in range(1, max_compiles + 1):
    around = ("the planner's, one schedule field changed for every ring" if center is None
              else f'{schedule_label(center)} and each change of one field'
              if round_ == 1 else f'one schedule field changed from {schedule_label(center)}')
    progress(f"tune ours' ring schedules at {where}, round {round_}: planning {len(grid_)} "
             f'candidates ({around})')
    plans = plan_all(grid_)
    if isinstance(plans, str):
      progress(f'error: planning the candidates: {plans}')
      return 1
    distinct = _distinct(grid_, plans, seen, progress if center is None else None)
    chosen, left = distinct[:budget], distinct[budget:]
    left_out += [schedule_label(p) for p in left]
    progress(f'{len(distinct)} distinct plan(s)' + ('' if center is None else ' not compiled '
                                                    'before') + f'; compiling {len(chosen)}'
             + (f'; not compiled (--max_compiles {max_compiles}): '
                + ', '.join(schedule_label(p) for p in left) if left else '')
             + ('' if len(distinct) > 1 or center else ' (every candidate plans the same: it '
                                                     'runs no ring, nothing to tune)'))
    for i, prefer in enumerate(chosen):
      rows.append(_tune_row(prefer, compile_one, f'[{i + 1}/{len(chosen)}]', progress))
      prefers[rows[-1][0]] = prefer
    budget -= len(chosen)
    best = best_row(rows, 'ours')
    if left or not budget or best is None or not _faster(best, rows, center):
      break
    center = prefers[best[0]]
    grid_ = neighbours(center, mesh_shape)
  progress(f'compiled {len(rows)} schedule(s) in {time.perf_counter() - began:.0f} s')
  return _tune_result(rows, left_out, max_compiles, write_plan, plan_out)


def _faster(best, rows, center: dict | None) -> bool:
  """Whether ``best`` (a fitting row) models ``ROUND_MIN_GAIN`` faster than the program of
  ``center`` (the planner's where None), or that one did not compile or fit."""
  step = lambda row: row[3]['modeled']['ours']['step_seconds']
  start = next((r for r in rows if r[0] == schedule_label(center or {})), None)
  if start is None or best_row([start], 'ours') is None:
    return True
  return step(best) < (1 - ROUND_MIN_GAIN) * step(start)


def _distinct(grid_: list[dict], plans: list[dict], seen: dict, progress) -> list[dict]:
  """The candidates of ``grid_`` whose plans none before had (``seen``: plan key -> the
  first candidate that planned it, updated), each skip named through ``progress`` if any."""
  distinct = []
  for prefer, plan in zip(grid_, plans):
    first = seen.setdefault(plan_key(plan), prefer)
    if first is prefer:
      distinct.append(prefer)
    elif progress:
      progress(f'  skip {schedule_label(prefer)}: the same plan as {schedule_label(first)}')
  return distinct


def _tune_result(rows, left_out: list[str], max_compiles: int, write_plan,
                 plan_out: str) -> int:
  """``--tune``'s table, what it left out, and the plan of the fastest that fits written."""
  print(table(rows, ['ours'], what='schedule', steps=True))
  if left_out:
    print(f'not compiled (--max_compiles {max_compiles}): ' + ', '.join(left_out))
  best = best_row(rows, 'ours')
  if best is None:
    print(f'{plan_out} not written: no compiled schedule fits')
    return 1
  command = write_plan(best[3]['plan'])
  print(f'wrote {plan_out}: the plan of {best[0]}; to train with it:\n  {command}')
  return 0


def _tune_row(prefer: dict, compile_one, count: str, progress) -> tuple:
  """One ``--tune`` candidate compiled: its table row, its progress line printed."""
  label, began = schedule_label(prefer), time.perf_counter()
  s = compile_one(prefer)
  if isinstance(s, str):
    progress(f'{count} {label}: compile failed: {s}')
    s = None
  else:
    step = s['modeled'].get('ours', {}).get('step_seconds')
    progress(f'{count} {label}: modeled step ' + (f'{step:.4f} s' if step else '-')
             + f", {s['variants']['ours']['memory']['fit']} "
             f'({time.perf_counter() - began:.0f} s)')
  return label, None, None, s


def best_row(rows, variant: str):
  """The row of ``table``'s rows whose ``variant`` program fits with the highest modeled
  MFU (the fastest modeled step of one config), the first of equals; None if none fits."""
  best = None
  for row in rows:
    s = row[3]
    mfu = s and s['modeled'].get(variant, {}).get('mfu')
    fits = s and s['variants'].get(variant, {}).get('memory', {}).get('fit') == 'FITS'
    if mfu and fits and (best is None or mfu > best[3]['modeled'][variant]['mfu']):
      best = row
  return best


def aligned(rows) -> list[str]:
  """Rows of strings as left-aligned columns two spaces apart."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def ranking(kept, usable: float) -> str:
  """The layouts that passed, best first, with the estimates that ranked them; those
  estimated above the ``usable`` bytes (within the margin) marked."""
  head = ['rank', 'layout', 'est GiB', 'analytical MFU']
  lines = [[str(i + 1), str(layout), f'{estimate / 2**30:.1f}' + '*' * (estimate > usable),
            f'{mfu:.1%}'] for i, (layout, estimate, mfu) in enumerate(kept)]
  out = aligned([head] + lines)
  if any(estimate > usable for _, estimate, _ in kept):
    out.append(f'(*: estimated above the usable {usable / 2**30:.2f} GiB, within the '
               f"estimate's {ESTIMATE_MARGIN:.0%} margin: compile it to know)")
  out.append('(estimates, not compiled: --max_compiles N compiles the first N)')
  return '\n'.join(out)


def table(rows, variants, what: str = 'layout', steps: bool = False) -> str:
  """The compiled layouts (or ``--refine``'s settings, ``--tune``'s schedules: ``what``):
  each variant's memory (one GiB figure, or one per variant in column order where they
  differ), fit and modeled MFU (and step seconds, ``steps``); the best per variant among
  those where that variant's own program fits."""
  estimated = any(r[1] is not None for r in rows)  # --refine estimates nothing
  est = lambda e: [f'{e / 2**30:.1f}'] if estimated else []
  head = [what] + (['est GiB'] if estimated else []) + ['GiB/chip', 'fit'] + [
      f'{v} {c}' for v in variants for c in ['MFU'] + ['step s'] * steps]
  lines, best, differ = [], {}, False
  for layout, estimate, _, s in rows:
    if s is None:
      lines.append([str(layout), *est(estimate), '-', 'compile failed'] +
                   ['-'] * len(variants) * (1 + steps))
      continue
    done = [v for v in variants if v in s['variants']]  # --refine compiles some once
    mems = {v: s['variants'][v].get('memory') or {} for v in done}
    fits = {v: mems[v].get('fit') == 'FITS' for v in done}
    gib = [f"{m['total'] / 2**30:.1f}" if 'total' in m else '-' for m in mems.values()]
    differ |= len(set(gib)) > 1
    unfit = [v for v in done if not fits[v]]
    cells = [str(layout), *est(estimate), ' / '.join(gib) if len(set(gib)) > 1
             else gib[0], 'FITS' if not unfit else 'DOES NOT FIT' if len(unfit) == len(done)
             else 'DOES NOT FIT: ' + ', '.join(unfit)]
    for v in variants:
      mfu = s['modeled'].get(v, {}).get('mfu')
      cells.append((f'{mfu:.1%}' + ('' if fits[v] else ' (does not fit)')) if mfu else
                   '-' if v in done else 'not compiled')
      step = s['modeled'].get(v, {}).get('step_seconds')
      cells += [f'{step:.4f}' if step else '-'] * steps
      if mfu and fits[v] and mfu > best.get(v, (0, None))[0]:
        best[v] = (mfu, layout, step)
    lines.append(cells)
  out = aligned([head] + lines)
  if differ:
    out.append(f'(GiB/chip: compiled, per variant where they differ: {" / ".join(variants)})')
  out.append('(modeled MFU: the step model over each compiled program; not measured)')
  for v, (mfu, layout, step) in best.items():
    out.append(f'best for {v}: {layout} ({mfu:.1%} modeled MFU'
               + (f', modeled step {step:.4f} s)' if steps else ')'))
  for v in variants:
    if v not in best:
      out.append(f'best for {v}: none (its program fits at no compiled {what})')
  return '\n'.join(out)
