"""Expert parallelism: the all-to-all around expert FFNs, whole or in chunks.

Tokens dispatched to expert slots, ``[batch, exp, capacity, embed]``, are laid
out by batch: the ``batch`` rule includes the expert mesh axis (last), so each
device holds whole groups. The experts need ``[exp, batch, capacity, embed]``
with ``exp`` on that axis. ``exchange`` moves between the two with one
``all_to_all`` over the expert axis inside a ``shard_map``, and back the same
way after the experts ran.

Decomposed (``chunked``): the capacity slots are split into C chunks and each
chunk is exchanged, computed and exchanged back on its own, so the all-to-all of
chunk i+1 can overlap the expert compute of chunk i (and the return of chunk i
the compute of chunk i+1). Routing happened before, on whole groups, so the
chunks only split work that is already assigned: results equal the single
exchange up to float summation order (none here: each slot is computed once).

Modeled time (``estimate``), per device, with ``B`` the bytes of one device's
dispatched tokens, ``n`` the expert-axis size, ``W`` the bytes of the expert
weights one device reads (its experts' three matrices) and ``F`` the expert FLOPs
on one device:

* one all-to-all: ``a``, the step model's formula for a collective
  (``pricing.ring_collective_seconds``: ``B (n-1)/n`` over both directions of
  the ring, the expert axis taken as one torus dimension, plus its latency);
* the experts on a C-th of the tokens: ``T(C) = max(F / C / peak, (W + 2 B / C) /
  HBM bandwidth)``, the step model's max(FLOPs, bytes) rule (``pricing.compute_seconds``):
  every chunk reads all of the weights again, and its tokens in and out (hidden
  activations not counted);
* ``single``: ``2a + T(1)``;
* ``chunked`` with C chunks, each chunk's all-to-all ``a_C`` (the same formula for
  ``B / C``: a C-th of the bytes, all of the latency), asynchronous all-to-alls
  (``async_all_to_all`` in the hardware table: GPUs; the TPU compiler blocks on
  them): a three-stage pipeline whose link is shared by both exchanges,
  ``2 a_C + T(C) + (C-1) x max(T(C), 2 a_C)``; otherwise ``2 C a_C + C T(C)``.
  Small chunks of many experts' tokens become bound by the weights' reads, so
  chunking is chosen only where each chunk still keeps the chip's MXUs busy.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from parallelism import hardware as hw, pricing
from parallelism.einsum_plan import axes_of


@dataclasses.dataclass(frozen=True)
class ExchangeDecision:
  """How one MoE layer's expert all-to-all runs, and why."""
  mode: str                 # single | chunked
  chunks: int
  axis: str | None          # the expert mesh axis (None: no expert parallelism)
  chunk_shape: tuple        # global [exp, batch, capacity chunk, embed] per exchange
  seconds: dict             # modeled seconds per mode (per device)
  hardware: str
  reason: str


def estimate(shape_becd, itemsize: int, expert_flops: float, devices: int, n: int,
             chunks: int, hardware: str, shards: int | None = None,
             weight_bytes: float = 0.0) -> dict[str, float]:
  """Modeled seconds of ``single`` and ``chunked`` (see the module docstring).

  ``shards``: how many blocks the dispatched tokens are split into (default
  ``devices``; fewer where devices hold the same tokens). ``weight_bytes``: the
  expert weights one device reads in each pass over its tokens.
  """
  profile = hw.get_profile(hardware)
  peak, link, hbm = pricing.rates(profile)
  tokens = math.prod(shape_becd) * itemsize / (shards or devices)
  exchange = lambda parts: pricing.ring_collective_seconds(
      tokens / parts, [n], link, profile.ring_links, profile.step_latency)
  a, a_c = exchange(1), exchange(chunks)
  experts = lambda parts: pricing.compute_seconds(
      expert_flops / devices / parts, weight_bytes + 2 * tokens / parts, peak, hbm)
  t_c = experts(chunks)
  if profile.async_collectives and profile.async_all_to_all:
    chunked = 2 * a_c + t_c + (chunks - 1) * max(t_c, 2 * a_c)
  else:
    chunked = 2 * chunks * a_c + chunks * t_c
  return {'single': 2 * a + experts(1), 'chunked': chunked}


def decide(shape_becd, itemsize, expert_flops, mesh, axis, chunks: int, mode: str,
           hardware: str, dispatched: PartitionSpec = PartitionSpec(),
           weight_bytes: float = 0.0) -> ExchangeDecision:
  """One layer's exchange in ``mode``: single | chunked | auto (the cost model picks).

  ``MatmulPolicy.choose`` asks for single under ``collective_matmul=never`` and
  chunked under ``always``; the reasons name those settings. ``dispatched``: the
  tokens' layout before the exchange; where it splits the capacity dim (experts
  tensor-parallel over that axis), the exchange is single, since a chunk of slots
  would span devices. ``weight_bytes``: the expert weights a device reads per pass.
  """
  n = mesh.shape[axis] if axis else 1
  b, e, c, d = shape_becd
  chunk_shape = lambda k: (e, b, c // k, d)
  size = lambda entry: math.prod(mesh.shape[a] for a in axes_of(entry))
  shards = math.prod(size(entry) for entry in dispatched) if len(dispatched) else None
  seconds = estimate(shape_becd, itemsize, expert_flops, mesh.size, n, chunks, hardware,
                     shards, weight_bytes)
  if n == 1:  # (an expert axis of size 1 is none: nothing is exchanged)
    return ExchangeDecision('single', 1, None, chunk_shape(1), seconds, hardware,
                            'no expert parallelism: no all-to-all')
  if mode != 'single' and chunks > 1 and len(dispatched) > 2 and size(dispatched[2]) > 1:
    return ExchangeDecision('single', 1, axis, chunk_shape(1), seconds, hardware,
                            f'capacity is split over {dispatched[2]}: a chunk of slots '
                            'would span devices')
  if mode == 'single' or chunks == 1:
    why = 'collective_matmul="never"' if mode == 'single' else 'moe.overlap_chunks=1'
    return ExchangeDecision('single', 1, axis, chunk_shape(1), seconds, hardware, why)
  if mode == 'chunked':
    return ExchangeDecision('chunked', chunks, axis, chunk_shape(chunks), seconds, hardware,
                            'collective_matmul="always"')
  mode = min(seconds, key=seconds.get)
  k = chunks if mode == 'chunked' else 1
  return ExchangeDecision(mode, k, axis, chunk_shape(k), seconds, hardware,
                          f'cost model ({hardware}) picks {mode}')


def exchange(x, mesh, axis: str, in_spec: PartitionSpec, out_spec: PartitionSpec):
  """Swaps dims 0 and 1 and moves ``axis`` from dim 0 to dim 1: one all-to-all.

  ``[batch, exp, ...]`` sharded by batch (``axis`` last) -> ``[exp, batch, ...]``
  with exp on ``axis``; called with the specs swapped, it goes back.
  """
  def swap(xl):
    y = jax.lax.all_to_all(xl, axis, split_axis=1, concat_axis=0, tiled=True)
    return jnp.swapaxes(y, 0, 1)
  return jax.shard_map(swap, mesh=mesh, in_specs=in_spec, out_specs=out_spec)(x)


def check_layout(axis: str, dispatched: PartitionSpec, at_experts: PartitionSpec) -> None:
  """Raises ValueError unless the two layouts are what ``exchange`` moves between."""
  batch_in, exp_at = axes_of(dispatched[0]), axes_of(at_experts[0])
  batch_at = axes_of(at_experts[1])
  if (exp_at != (axis,) or not batch_in or batch_in[-1] != axis
      or batch_in[:-1] != batch_at or axes_of(dispatched[1])):
    raise ValueError(
        f'expert parallelism over {axis!r} needs the batch rule to end with {axis!r} and a '
        f'second batch rule without it (e.g. [batch, [data, fsdp, {axis}]], [batch, '
        f'[data, fsdp]], [exp, {axis}]); got dispatched tokens {dispatched} and expert '
        f'inputs {at_experts}')


def run(decision: ExchangeDecision, x_becd, expert_fn, mesh, dispatched: PartitionSpec,
        at_experts: PartitionSpec):
  """Runs ``expert_fn`` on ``x_becd`` as ``decision`` says; returns ``[batch, exp, c, d]``."""
  put = lambda v, spec: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))
  if decision.axis is None:
    return jnp.swapaxes(expert_fn(jnp.swapaxes(x_becd, 0, 1)), 0, 1)
  outs = []
  for x_chunk in jnp.split(put(x_becd, dispatched), decision.chunks, axis=2):
    with jax.named_scope(f'moe_chunk{len(outs)}'):
      x_ebcd = exchange(x_chunk, mesh, decision.axis, dispatched, at_experts)
      y_ebcd = expert_fn(x_ebcd)
      outs.append(exchange(put(y_ebcd, at_experts), mesh, decision.axis, at_experts,
                           dispatched))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
