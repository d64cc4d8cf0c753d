"""Decomposed collective einsums: the technique this framework is built on.

``collective_einsum(equation, lhs, rhs, mesh=..., lhs_spec=..., rhs_spec=...,
out_spec=...)`` computes ``jnp.einsum(equation, lhs, rhs)`` for operands laid
out as ``lhs_spec``/``rhs_spec`` and returns it laid out as ``out_spec``. The
collective the layout implies along one mesh axis (an all-gather before the
einsum, or a reduce-scatter after it) is decomposed together with the einsum
into a ring of collective-permutes and partial einsums (parallelism/ring.py),
so that on TPU/GPU each transfer overlaps the previous step's compute.

Other mesh axes are left to the compiler: the ring runs in a ``shard_map``
that is manual over the decomposed axis only. The gradient is decomposed too:
the transpose of an all-gather einsum is an einsum reduce-scatter and vice
versa, and the custom VJP calls this function for both operand gradients.

This module runs what a ``Decision`` says (``run_decision``); parallelism/decision.py decides
it (``explain``), and parallelism/ring_specs.py holds what both read of a ring's layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.experimental import layout
from jax.sharding import NamedSharding, PartitionSpec

from parallelism import einsum_plan, pair_sums, ring
from parallelism.einsum_plan import AxisPlan, Equation
from parallelism.decision import DECOMPOSABLE, Decision, explain
from parallelism.ring_specs import (
    Static, axis_plan, gather_first_spec, gathered_dims_major, halved_letter,
    hands_cotangent_on, hoisted_specs, kernel_form, manual_extra, static, summed_over)

SCOPE = ring.RING_SCOPE


def collective_einsum(equation: str, lhs: jax.Array, rhs: jax.Array, *, mesh,
                      lhs_spec, rhs_spec, out_spec, mode: str = 'auto', hardware=None,
                      ring_dtype: str = 'compute',
                      prefer: Mapping[str, Any] | None = None) -> jax.Array:
  """``einsum(equation, lhs, rhs)`` with its collective decomposed over a ring.

  Args:
    equation: e.g. ``"btd,df->btf"``.
    lhs, rhs: global arrays laid out as ``lhs_spec`` / ``rhs_spec`` (resharded
      to them if they are not).
    mesh: the device mesh; all axes Auto (an Explicit axis raises ValueError).
    lhs_spec, rhs_spec, out_spec: PartitionSpecs over ``mesh``.
    mode: ``none`` (plain einsum; the compiler inserts the collective),
      ``unidirectional``, ``bidirectional``, or ``auto`` (the cost model picks).
    hardware: a ``parallelism.hardware`` profile name for the cost model
      (default: ``cpu``, where nothing overlaps and the cost model never picks a ring).
    ring_dtype: what partial sums travel and rest in (``RING_DTYPES``): the rings'
      accumulators (a reduce-scatter's on the wire, a contracting all-gather's between
      steps), and under ``none`` the dot's output, which the compiler's reduce-scatter
      or all-reduce carries.
    prefer: ring schedule settings to use instead of the planner's, where they apply
      (``parallelism/schedule.py``), e.g. ``{'unroll': 2}``.

  Returns:
    The result laid out as ``out_spec``; bf16 products accumulate in fp32 on
    each device (in the MXU under ``none``).
  """
  explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types)
              if t != jax.sharding.AxisType.Auto]
  if explicit:  # operands are resharded with constraints, which need Auto axes
    raise ValueError(f'collective_einsum needs a mesh whose axes are all Auto; {explicit} '
                     'are not (parallelism.mesh.make_mesh builds Auto meshes)')
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  decision = explain(equation, lhs.shape, rhs.shape, dtype, mesh=mesh, lhs_spec=lhs_spec,
                     rhs_spec=rhs_spec, out_spec=out_spec, mode=mode, hardware=hardware,
                     ring_dtype=ring_dtype, prefer=prefer)
  return run_decision(decision, lhs, rhs, mesh=mesh, lhs_spec=lhs_spec, rhs_spec=rhs_spec,
                      out_spec=out_spec)


def run_decision(decision: Decision, lhs, rhs, *, mesh, lhs_spec, rhs_spec,
                 out_spec) -> jax.Array:
  """Computes the einsum as ``decision`` (from ``explain``) says: its mode, axis, gradient
  forms, ``ring_dtype`` and each ring's schedule (``decision.schedules``).

  ``decision.ring_order`` ('lhs' or 'out'; '' none) names the operand or result whose
  blocks along the ring's dimension are in ring order on each device
  (``ring.ring_position``): where only position-wise work lies between a ring that gathers
  an activation and one that scatters it back, the tokens need not be put back in order
  between them (``ring_order_fits`` says where it may be asked).
  """
  order = decision.ring_order
  if order and not ring_order_fits(decision, lhs_spec, rhs_spec, out_spec, order):
    raise ValueError(f'{decision.equation}: ring_order={order!r} needs every einsum of it '
                     f'a ring over {decision.axis} holding the {order} whole along it')
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  put = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  lhs, rhs = put(lhs, PartitionSpec(*lhs_spec)), put(rhs, PartitionSpec(*rhs_spec))
  if not decision.decomposed:
    out = _plain(decision.equation, lhs, rhs, dtype, decision.ring_dtype == 'float32')
  else:  # a ring forward, or a plain one whose gradients ring (cfg.axis None)
    out = _decomposed(static(decision, (lhs_spec, rhs_spec, out_spec), mesh), lhs, rhs)
  return put(out, PartitionSpec(*out_spec))


def ring_order_fits(decision: Decision, lhs_spec, rhs_spec, out_spec, array: str) -> bool:
  """Whether ``array`` ('lhs', 'rhs' or 'out') of the einsum ``decision`` runs can hold its
  blocks in ring order: the forward and both gradients are rings over the same axis, and
  each holds that array (or, in a gradient, its counterpart) whole along its ring."""
  if (decision.mode == 'none' or decision.backward != ('ring', 'ring') or
      any(o is not None and o[0] != decision.axis for o in decision.backward_over)):
    return False
  cfg = dataclasses.replace(static(decision, (lhs_spec, rhs_spec, out_spec), None),
                            ring_order=array)
  return all(_whole_along_ring(c) == c.ring_order
             for c in (cfg, cfg.transposed('lhs'), cfg.transposed('rhs')))


def _whole_along_ring(cfg: Static) -> str | None:
  """Which of (lhs, rhs, out) the ring of ``cfg`` holds whole along its dimension: an
  all-gather ring's result or the operand it does not gather, a reduce-scatter ring's
  sliced operand (None: not a ring)."""
  eq, plans = einsum_plan.plan(cfg.equation, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  plan = next((p for p in plans if p.axis == cfg.axis), None)
  if plan is None or plan.kind not in DECOMPOSABLE:
    return None
  if plan.kind == 'allgather_free':
    return 'out'
  if plan.kind == 'allgather_contracting':
    return 'rhs' if plan.gathered == 'lhs' else 'lhs'
  return 'lhs' if plan.out_letter in eq.lhs else 'rhs'


def _plain(equation: str, lhs, rhs, dtype, wire_fp32: bool):
  """One einsum, whose collectives the compiler inserts. The dot's output type is what the
  compiler's reduce-scatter or all-reduce of partial sums carries: the compute dtype (the
  MXU still accumulates each shard's products in fp32), as the rings do, unless
  ``ring_dtype`` says float32."""
  return jnp.einsum(equation, lhs, rhs,
                    preferred_element_type=_wire(dtype, wire_fp32)).astype(dtype)


def _acc(dtype):
  return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def _wire(dtype, fp32: bool):
  """What partial sums of a ``dtype`` einsum travel in: ``dtype`` itself, or at least
  fp32 under ``ring_dtype='float32'``."""
  return _acc(dtype) if fp32 else dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decomposed(cfg: Static, lhs, rhs):
  return _forward(cfg, lhs, rhs)


def _forward(cfg: Static, lhs, rhs):
  if cfg.axis is None:
    return _plain(cfg.equation, lhs, rhs, jnp.result_type(lhs.dtype, rhs.dtype),
                  cfg.wire_fp32)
  return _ring_einsum(cfg, lhs, rhs)


def _decomposed_fwd(cfg, lhs, rhs):
  return _forward(cfg, lhs, rhs), (lhs, rhs)


def _decomposed_bwd(cfg, residuals, g):
  lhs, rhs = residuals
  if hands_cotangent_on(cfg):
    # The data gradient's ring gathers g over the forward's axis block by block; the
    # weight gradient's ring over another axis (fsdp) gets g whole from it instead of the
    # compiler gathering it again (the same bytes twice over the same links). Not for a
    # weight gradient as one einsum: the compiler then kept g whole longer (moe_1t's
    # attn.o and mlp.down: 31.69 GiB per chip, 29.88 with the compiler's gather).
    d_lhs, g = _transpose_einsum(cfg.transposed('lhs'), g, rhs, lhs.dtype, keep_gathered=True)
  else:
    if cfg.schedules[2] is not None and cfg.schedules[2].gather == 'before':
      lhs, g = _gathered_first(cfg, lhs, g)
    d_lhs = _transpose_einsum(cfg.transposed('lhs'), g, rhs, lhs.dtype, cfg.backward[0])
  d_rhs = _transpose_einsum(cfg.transposed('rhs'), lhs, g, rhs.dtype, cfg.backward[1])
  return d_lhs, d_rhs


def _gathered_first(cfg: Static, lhs, g):
  """``lhs`` as the weight gradient's ring over another axis takes it, gathered over the
  forward's axis by the compiler, and ``g`` held back until it is (``ring.waiting_for``):
  where the data gradient's ring over the forward's axis is bidirectional, its transfers
  fill both directions of the links that gather runs on, and beside it one queued behind
  the other (dense_500b's ``attn.qkv``: 0.060 s a step exposed, 0.020 s with the gather
  first; modeled, docs/paper_scale.md). Else both as they were."""
  spec = gather_first_spec(cfg)
  if spec is not None:  # the compiler gathers it
    lhs = jax.lax.with_sharding_constraint(lhs, NamedSharding(cfg.mesh, spec))
    g = ring.waiting_for(g, lhs)
  return lhs, g


_decomposed.defvjp(_decomposed_fwd, _decomposed_bwd)


def _transpose_einsum(cfg: Static, a, b, dtype, form: str = 'ring',
                      keep_gathered: bool = False):
  """A gradient einsum, decomposed over the same axis when its pattern allows and
  ``form`` is 'ring'; else one einsum over what the compiler gathers. With
  ``keep_gathered`` (a ring), also the operand the ring gathered (``_ring_einsum``)."""
  whole = None
  if form == 'ring' and cfg.axis and axis_plan(cfg)[1].kind in DECOMPOSABLE:
    out = _ring_einsum(cfg, a, b, keep_gathered)
    if keep_gathered:
      out, whole = out
  else:  # e.g. an all-reduce: the compiler's collective, of partial sums in the wire dtype
    out = jnp.einsum(cfg.equation, a, b, preferred_element_type=_wire(dtype, cfg.wire_fp32))
  out = jax.lax.with_sharding_constraint(out, NamedSharding(cfg.mesh, cfg.out_spec))
  return (out.astype(dtype), whole) if keep_gathered else out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """What each device's ring body needs, fixed when the einsum is traced."""
  eq: Equation
  plan: AxisPlan          # the decomposed axis and its collective
  n: int                  # devices on the ring
  split: tuple[int, int]  # ring.ring_split: contributions arriving from each direction
  unroll: int | bool      # ring steps per loop iteration (True: all of them)
  dtype: Any              # the einsum's result dtype
  wire: Any               # what partial sums travel and rest in between ring steps
  manual: tuple[str, ...]  # the shard_map's manual axes: the ring's, then ``summed``
  summed: tuple[str, ...]  # axes whose partial sums are reduced after the ring
  scatter: dict           # output dim -> the summed axes it is reduce-scattered over
  reduce_dtype: Any       # what the reduction over ``summed`` carries
  keep: bool = False      # an all-gather ring also returns the operand it gathered, whole
  contiguous: bool = False  # contiguous_blocks on the operands the rings slice
  last_apart: bool = False  # a reduce-scatter ring's own contribution kept out of the fusions
  row_major: bool = False  # a reduce-scatter ring's accumulators in the default layout
  # its schedule's additions 'fused': a reduce-scatter ring's additions in its einsums, its
  # accumulators in halves (``schedule._additions_for`` says which rings: a bidirectional
  # weight gradient's einsums, one a direction, would read the activation each round twice:
  # HBM-bound, dense_500b +0.84 s a step)
  fused_additions: bool = False
  # its schedule's additions 'kernel': an even bidirectional weight-gradient ring runs each
  # round as one Pallas kernel for both directions (``_pair_kernel_ring``): 'mosaic'
  # (compiled for a TPU), 'interpret' (Pallas's interpreter elsewhere), or ''
  pair_kernel: str = ''
  # its schedule's pairs 'apart': a bidirectional all-gather ring without partial sums runs
  # an einsum a block, each product written where it goes, not one einsum over the pair
  apart_pairs: bool = False
  # the array the ring holds whole along its dimension has its blocks in ring order
  # (``ring.ring_position``; ``Static.ring_order``)
  ring_order: bool = False


def _ring_einsum(cfg: Static, lhs, rhs, keep_gathered: bool = False):
  """Runs the decomposed einsum in a shard_map manual over ``cfg.axis`` (and summed axes).

  With ``keep_gathered`` (an all-gather ring without partial sums, ``keeps_cotangent``),
  returns the result and the operand the ring gathered, whole over ``cfg.axis``: the
  blocks that passed.
  """
  named, before = cfg.equation, Equation.parse(cfg.equation)
  cfg, lhs, rhs = gathered_dims_major(cfg, lhs, rhs)
  eq, plan = axis_plan(cfg)
  n = cfg.mesh.shape[cfg.axis]
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  # XLA's in-process CPU collectives can fail when one collective-permute runs
  # again right away, as in a loop: a device that is fast re-enters the
  # rendezvous of the previous step before the slow ones have left it ("Check
  # failed: state.use_count() == num_threads (9 vs. 8)", seen with 8 fake
  # devices). On CPU the ring is therefore fully unrolled, so every step has
  # its own ops; other backends keep the loop and ``unroll``.
  on_cpu = cfg.mesh.devices.flat[0].platform == 'cpu'
  sched = cfg.sched
  unroll = True if on_cpu else sched.unroll
  direction = 'bidirectional' if cfg.bidirectional else 'unidirectional'
  # Collectives over other axes (an FSDP weight's gather) happen once, here,
  # not once per ring step inside the loop, where the compiler would put them.
  lhs_spec, rhs_spec = hoisted_specs(eq, cfg.axis, cfg.lhs_spec, cfg.rhs_spec, cfg.out_spec)
  lhs = jax.lax.with_sharding_constraint(lhs, NamedSharding(cfg.mesh, lhs_spec))
  rhs = jax.lax.with_sharding_constraint(rhs, NamedSharding(cfg.mesh, rhs_spec))
  extra = manual_extra(cfg, eq, lhs_spec, rhs_spec)
  summed = extra[:len(summed_over(cfg, eq, lhs_spec, rhs_spec))]
  manual = (cfg.axis,) + extra
  # A Mosaic kernel runs only where every mesh axis is manual: a pair-kernel ring has every
  # axis of size > 1 manual already (the planner checked: ``_kernel_problem``) and makes the
  # others (of size 1) manual too.
  kernel = sched.additions == 'kernel'
  if kernel:
    manual += tuple(a for a in cfg.mesh.axis_names if a not in manual)
  keep = lambda spec: PartitionSpec(*[
      einsum_plan.spec_entry(tuple(a for a in einsum_plan.axes_of(e) if a in manual))
      for e in spec])
  scatter, out_spec = _reduction(eq, summed, cfg.out_spec, manual)
  # Partial sums over ``summed`` cross devices in the wire dtype, as the compiler's
  # reductions of plain einsums do: bf16 halves a weight gradient's reduce-scatter. XLA's
  # CPU backend aborts on a bf16 psum here ("Invalid binary instruction opcode copy"), so
  # on CPU they are reduced in fp32.
  r = _Ring(eq, plan, n, ring.ring_split(n, cfg.bidirectional), unroll, dtype,
            _wire(dtype, cfg.wire_fp32), manual, summed, scatter,
            _wire(dtype, cfg.wire_fp32 or on_cpu), keep_gathered, sched.layout == 'contiguous',
            sched.last == 'apart', sched.layout == 'contiguous' and cfg.activation_out,
            sched.additions == 'fused',
            ('' if not kernel else
             'mosaic' if cfg.mesh.devices.flat[0].platform == 'tpu' else 'interpret'),
            sched.pairs == 'apart', bool(cfg.ring_order))  # run_decision checked it fits
  if keep_gathered:
    if summed or plan.kind == 'reducescatter':
      raise ValueError(f'{named}: only an all-gather ring without partial sums over other '
                       f'axes keeps what it gathered (summed over {summed}, {plan.kind})')
    gathered = lhs_spec if plan.gathered == 'lhs' else rhs_spec
    out_spec = (out_spec, PartitionSpec(*[einsum_plan.spec_entry(tuple(
        a for a in einsum_plan.axes_of(e) if a in manual and a != cfg.axis)) for e in gathered]))
  # The scope names our ops in HLO metadata, so schedules can be checked.
  with jax.named_scope(f'{SCOPE}/{plan.kind}/{direction}/{named}'):
    out = jax.shard_map(functools.partial(_local, r), mesh=cfg.mesh,
                        in_specs=(PartitionSpec(cfg.axis), keep(lhs_spec), keep(rhs_spec)),
                        out_specs=out_spec, axis_names=set(manual),
                        # every device of the ring holds the same whole operand, which the
                        # type check cannot see in blocks written one ring step at a time;
                        # nor can it follow a kernel's varying block indices (Pallas's
                        # interpreter) or outputs (Mosaic's, over the size-1 axes made manual)
                        check_vma=not keep_gathered and not r.pair_kernel)(
                            ring.ring_positions(n), lhs, rhs)
  if not keep_gathered:
    return out
  old, new = ((before.lhs, eq.lhs) if plan.gathered == 'lhs' else (before.rhs, eq.rhs))
  return out[0], jnp.transpose(out[1], [new.index(l) for l in old])


def _reduction(eq: Equation, summed, out_spec, manual):
  """(dims to psum_scatter {dim: axes}, the shard_map's out spec) for the summed axes.

  An output dim sharded over summed axes only gets a reduce-scatter over them;
  the remaining summed axes get an all-reduce.
  """
  out = einsum_plan.letter_axes(eq.out, out_spec)
  scatter = {}
  for dim, letter in enumerate(eq.out):
    axes = out[letter]
    if axes and all(a in summed for a in axes):
      scatter[dim] = axes
  spec = []
  for dim, letter in enumerate(eq.out):
    kept = scatter.get(dim) or tuple(a for a in out[letter] if a in manual and a not in summed)
    spec.append(einsum_plan.spec_entry(kept))
  return scatter, PartitionSpec(*spec)


def _local(r: _Ring, ids, lhs, rhs):
  """Per-device body: blocks along the manual axes are local, other axes global.

  The result holds partial sums over ``r.summed`` until the end, where each dim
  in ``r.scatter`` is reduce-scattered over its axes and the rest all-reduced,
  in ``r.reduce_dtype``.
  """
  if r.plan.kind == 'reducescatter':
    out = _reduce_scatter_local(r, ids[0], lhs, rhs)
  else:
    out = _all_gather_local(r, ids[0], lhs, rhs)
  if not r.summed:
    return out
  out = out.astype(r.reduce_dtype)
  scattered = set()
  for dim, axes in r.scatter.items():
    out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
    scattered.update(axes)
  rest = tuple(a for a in r.summed if a not in scattered)
  return (jax.lax.psum(out, rest) if rest else out).astype(r.dtype)


def _reduce_scatter_local(r: _Ring, idx, lhs, rhs):
  """The reduce-scatter ring on local blocks; accumulators travel as ``r.wire``."""
  eq, z = r.eq, r.plan.out_letter  # the scattered output dim, whole in its operand
  on_lhs = z in eq.lhs
  owner = lhs if on_lhs else rhs
  dim = (eq.lhs if on_lhs else eq.rhs).index(z)
  block = owner.shape[dim] // r.n
  if r.contiguous:
    owner = contiguous_blocks(owner, dim)

  # Partial sums leave the MXU (fp32 inside) in the wire dtype, travel and wait in it.
  wire = r.wire

  other, other_letters = (rhs, eq.rhs) if on_lhs else (lhs, eq.lhs)
  if r.pair_kernel:  # the planner checked that it fits (``_kernel_problem``)
    return _pair_kernel_ring(r, idx, owner, other,
                             *kernel_form(eq, z, owner.shape, other.shape)).astype(r.dtype)
  at = lambda k: ring.ring_position(k, idx, r.n, r.ring_order)  # where block k sits
  halved = halved_letter(eq, z, other_letters, other.shape) if r.fused_additions else None

  def partial(*ks, after=None, half=None):  # one einsum for the output blocks ks, joined along z
    piece = jnp.concatenate([jax.lax.dynamic_slice_in_dim(owner, at(k) * block, block, dim)
                             for k in ks], axis=dim)
    # The wait is on the operand that is not sliced (a weight, already whole): on the
    # sliced one, whatever produces it would be written out whole first (64B: the
    # SwiGLU's gradient, joined from gate's and up's, a pass of its own). Halved after
    # it, the halves are read where the einsum reads them, not copied out of the loop.
    operand = other if after is None else ring.waiting_for(other, after)
    if half is not None:
      operand = jnp.split(operand, 2, other_letters.index(halved))[half]
    args = (piece, operand) if on_lhs else (operand, piece)
    return jnp.einsum(str(eq), *args,
                      preferred_element_type=wire if half is None else jnp.float32)

  laid_out = default_layout if r.row_major else lambda x: x
  out = ring.reduce_scatter_einsum(partial, axis=r.plan.axis, n=r.n, idx=idx, split=r.split,
                                   unroll=r.unroll, pair_axis=eq.out.index(z),
                                   last_apart=r.last_apart, laid_out=laid_out,
                                   halves_axis=None if halved is None
                                   else eq.out.index(halved))
  return out.astype(r.dtype)


def _pair_kernel_ring(r: _Ring, idx, owner, other, b, t, d, p, q, letters, halved):
  """A weight gradient's even bidirectional reduce-scatter ring whose rounds each run
  ``pair_sums.pair_sums`` (both directions' contributions from one read of ``other``, each
  added to its arriving accumulator half as it is written), in the kernel's shapes: the
  accumulators ``[P, rows, Q]`` travel in halves along ``halved`` (``ring._in_halves``).
  """
  rows, c = d // r.n, owner.ndim - 1  # c: the contracted letters' count
  xt = jnp.swapaxes(owner.reshape(b, t, d), 1, 2)  # [B, D, T]: owner's laid-out order
  order = list(range(c, other.ndim - 1)) + list(range(c)) + [other.ndim - 1]
  y = jnp.transpose(other, order).reshape(p, b, t, q)  # [P, B, T, Q]
  at = lambda k: ring.ring_position(k, idx, r.n, r.ring_order)

  def operand(after):
    return y if after is None else ring.waiting_for(y, after)

  def partial(k, after=None, half=None):
    ys = operand(after)
    ys = ys if half is None else jnp.split(ys, 2, 0 if halved == 0 else 3)[half]
    x = jax.lax.dynamic_slice_in_dim(xt, at(k) * rows, rows, 1)
    return jnp.einsum('bdt,pbtq->pdq', x, ys, preferred_element_type=(
        r.wire if half is None else jnp.float32))

  def pair(k1, k2, *, half, accs, after):
    return pair_sums.pair_sums(xt, operand(after), *accs, at(k1), at(k2), half=half,
                               interpret=r.pair_kernel == 'interpret')

  out = ring.reduce_scatter_einsum(partial, axis=r.plan.axis, n=r.n, idx=idx, split=r.split,
                                   unroll=r.unroll, last_apart=r.last_apart,
                                   halves_axis=halved, pair_sums=pair)
  sizes = dict(zip(letters, other.shape[c:-1] + (rows, q)))
  out = out.reshape([sizes[l] for l in letters])
  return jnp.transpose(out, [letters.index(l) for l in r.eq.out])


def _all_gather_local(r: _Ring, idx, lhs, rhs):
  """The all-gather ring on local blocks: every device's block of the gathered
  operand passes by and is consumed against the local other operand."""
  eq, plan, n, dtype, acc_dtype = r.eq, r.plan, r.n, r.dtype, _acc(r.dtype)
  g, o, g_letters, o_letters = ((lhs, rhs, eq.lhs, eq.rhs) if plan.gathered == 'lhs'
                                else (rhs, lhs, eq.rhs, eq.lhs))
  local_eq = f'{g_letters},{o_letters}->{eq.out}'
  x = plan.letter
  m = g.shape[g_letters.index(x)]
  at = lambda k: ring.ring_position(k, idx, n, r.ring_order) * m  # where block k goes
  if plan.kind == 'allgather_free':
    out_dim = eq.out.index(x)
    # Unidirectional with no loop: the parts are joined once (ring.all_gather_apart). A
    # bidirectional ring's pairs, joined so too, had their inputs copied instead (64B:
    # 4.342 -> 4.345 s, modeled); a loop needs the buffer.
    if not r.keep and not r.split[1] and (r.unroll is True or r.unroll >= n - 1):
      return ring.all_gather_apart(g, lambda block: jnp.einsum(
          local_eq, block, o, preferred_element_type=acc_dtype).astype(dtype),
          axis=plan.axis, n=n, idx=idx, dim=out_dim, ring_order=r.ring_order)
    out_shape = jax.eval_shape(lambda a, b: jnp.einsum(local_eq, a, b), g, o).shape
    out_shape = out_shape[:out_dim] + (m * n,) + out_shape[out_dim + 1:]
    # Every block is written before it is read: no zero-fill
    acc = jax.lax.pcast(ring.fresh_buffer(out_shape, dtype, after=g), r.manual,
                        to='varying')

    def consume_pair(acc, a, src_a, b, src_b):  # one einsum for both blocks
      both = jnp.einsum(local_eq, jnp.concatenate([a, b], g_letters.index(x)), o,
                        preferred_element_type=acc_dtype).astype(dtype)
      part_a, part_b = jnp.split(both, 2, axis=out_dim)
      acc = jax.lax.dynamic_update_slice_in_dim(acc, part_a, at(src_a), out_dim)
      return jax.lax.dynamic_update_slice_in_dim(acc, part_b, at(src_b), out_dim)

    def consume(acc, block, src):
      part = jnp.einsum(local_eq, block, o, preferred_element_type=acc_dtype)
      return jax.lax.dynamic_update_slice_in_dim(acc, part.astype(dtype), at(src), out_dim)

    if r.apart_pairs:  # ring.all_gather_einsum then consumes each block of a pair alone
      consume_pair = None
  else:  # allgather_contracting: o holds the whole contracting dim
    # Partial sums rest between steps in the wire dtype, as a reduce-scatter ring's do
    # (bf16 for a bf16 model: half an fp32 accumulator's memory and HBM traffic); each
    # step's product leaves the MXU in it and is added in fp32, rounded once.
    wire, o_dim = r.wire, o_letters.index(x)
    out_shape = jax.eval_shape(
        lambda a, b: jnp.einsum(local_eq, a, jax.lax.dynamic_slice_in_dim(b, 0, m, o_dim)),
        g, o).shape
    acc = jax.lax.pcast(jnp.zeros(out_shape, wire), r.manual, to='varying')

    def consume_pair(acc, a, src_a, b, src_b):  # both blocks contracted in one einsum
      pieces = [jax.lax.dynamic_slice_in_dim(o, at(s), m, o_dim) for s in (src_a, src_b)]
      return ring.sum_rounded(acc, jnp.einsum(
          local_eq, jnp.concatenate([a, b], g_letters.index(x)),
          jnp.concatenate(pieces, o_dim), preferred_element_type=wire))

    def consume(acc, block, src):
      piece = jax.lax.dynamic_slice_in_dim(o, at(src), m, o_dim)
      return ring.sum_rounded(acc, jnp.einsum(local_eq, block, piece,
                                              preferred_element_type=wire))

  if r.keep:  # every block that passes is also written into the whole operand
    consume, consume_pair = _keeping(consume, consume_pair, g_letters.index(x), m,
                                     r.contiguous)
    acc = (acc, jax.lax.pcast(ring.fresh_buffer(_times(g.shape, g_letters.index(x), n),
                                                g.dtype, after=g), r.manual, to='varying'))
  out = ring.all_gather_einsum(g, consume, acc, axis=plan.axis, n=n, idx=idx, split=r.split,
                               unroll=r.unroll, consume_pair=consume_pair)
  return (out[0].astype(dtype), out[1]) if r.keep else out.astype(dtype)


def _times(shape, dim, n):
  return shape[:dim] + (shape[dim] * n,) + shape[dim + 1:]


def contiguous_blocks(x: jax.Array, dim: int) -> jax.Array:
  """``x`` laid out so that its blocks along ``dim`` are contiguous, where ``dim`` is
  the minor dimension: it goes second-minor, the one before it minor.

  A weight-gradient ring over fsdp slices its activation operand along the model
  dimension, the minor one; left to itself, the compiler copies the whole operand into
  such a layout once a layer (dense_500b: 0.11 s a step; docs/paper_scale.md).
  """
  if x.ndim < 2 or dim != x.ndim - 1:
    return x
  order = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
  return layout.with_layout_constraint(x, layout.Layout(major_to_minor=order))


def default_layout(x: jax.Array) -> jax.Array:
  """``x`` in the default layout, its last dimension minor, as an einsum writes it.

  Under a ``contiguous`` schedule layout a reduce-scatter ring's accumulators of an
  activation ([b, t, d]) are pinned so: the compiler had laid them out as the weight
  gradient's operand of that shape is pinned (``contiguous_blocks``: d before t) and copied
  every step's product into that layout (dense_500b: 0.021 s a step of copies, 0.009 s off
  the step without them; modeled, docs/paper_scale.md).
  """
  return layout.with_layout_constraint(x, layout.Layout(major_to_minor=tuple(range(x.ndim))))


def _keeping(consume, consume_pair, dim, m, contiguous: bool = False):
  """``consume`` and ``consume_pair`` over (acc, whole): each block also written into
  ``whole`` at its source's offset along ``dim``; a ``consume_pair`` of None stays None
  (``ring.all_gather_einsum`` then keeps each block of a pair alone). With
  ``contiguous``, ``whole`` (the cotangent a weight-gradient ring over another axis slices
  next, along its last dimension) is laid out for that ring's blocks
  (``contiguous_blocks``)."""
  lay = (lambda w: contiguous_blocks(w, w.ndim - 1)) if contiguous else (lambda w: w)
  put = lambda whole, block, src: lay(
      jax.lax.dynamic_update_slice_in_dim(whole, block, src * m, dim))

  def keep_one(carry, block, src):
    acc, whole = carry
    return consume(acc, block, src), put(whole, block, src)

  def keep_pair(carry, a, src_a, b, src_b):
    acc, whole = carry
    return consume_pair(acc, a, src_a, b, src_b), put(put(whole, a, src_a), b, src_b)

  return keep_one, None if consume_pair is None else keep_pair
