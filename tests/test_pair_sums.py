"""parallelism/pair_sums.py: a bidirectional weight-gradient ring's round as one Pallas
kernel, run here in Pallas's interpreter (the TPU compile: tests/test_tpu_aot.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallelism import hlo_text, kernels, pair_sums


@pytest.mark.parametrize('p, q, by_p', [(1, 512, False), (2, 256, False), (4, 128, True)])
def test_both_sums_match_einsums_of_their_blocks_and_half(p, q, by_p):
  b, d, t, rows = 2, 64, 256, 16
  keys = jax.random.split(jax.random.key(0), 4)
  xt = jax.random.normal(keys[0], (b, d, t))
  y = jax.random.normal(keys[1], (p, b, t, q))
  acc_shape = (p // 2, rows, q) if by_p else (p, rows, q // 2)
  acc_a, acc_b = (jax.random.normal(k, acc_shape) for k in keys[2:])
  for half in (0, 1):
    got = jax.jit(lambda *a, h=half: pair_sums.pair_sums(*a, half=h, interpret=True))(
        xt, y, acc_a, acc_b, 1, 3)
    ys = jnp.split(y, 2, 0 if by_p else 3)[half]
    for out, k, acc in zip(got, (1, 3), (acc_a, acc_b)):
      want = jnp.einsum('bdt,pbtq->pdq', xt[:, k * rows:(k + 1) * rows], ys) + acc
      np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


def test_sums_leave_in_the_accumulators_dtype_added_in_fp32():
  # bf16 accumulators: each sum is the fp32 sum of the product and the accumulator, rounded once
  keys = jax.random.split(jax.random.key(1), 3)
  xt = jax.random.normal(keys[0], (1, 32, 128)).astype(jnp.bfloat16)
  y = jax.random.normal(keys[1], (1, 1, 128, 256)).astype(jnp.bfloat16)
  acc = (jax.random.normal(keys[2], (1, 16, 128)) * 100).astype(jnp.bfloat16)
  out, _ = pair_sums.pair_sums(xt, y, acc, acc, 0, 1, half=0, interpret=True)
  exact = jnp.einsum('bdt,pbtq->pdq', xt[:, :16].astype(jnp.float32),
                     y[..., :128].astype(jnp.float32)) + acc.astype(jnp.float32)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, exact.astype(jnp.bfloat16))


def test_shapes_that_do_not_fit_are_refused():
  xt, y = jnp.zeros((1, 32, 128)), jnp.zeros((1, 1, 128, 256))
  with pytest.raises(ValueError, match=r'pair_sums: xt \(1, 32, 128\), y \(1, 1, 128, 256\)'):
    pair_sums.pair_sums(xt, y, jnp.zeros((1, 16, 256)), jnp.zeros((1, 16, 256)), 0, 1,
                        half=0, interpret=True)  # an accumulator of every column, not half


def test_blocks_fit_vmem_and_set_how_often_rows_are_read():
  # dense_500b's gate/up weight gradient (two stacked halves, 160 rows, 4096 columns a
  # half) takes both halves and 1024 columns a grid step; a 512-row block leaves room for
  # 512 columns; v5p dense_64b's q/k/v (40 heads a half, 128 wide) takes 20 heads a step.
  blocks = pair_sums._blocks  # pylint: disable=protected-access
  assert blocks(2, 4096, 160, 512, 2, 2) == (2, 1024)
  assert blocks(1, 2048, 512, 512, 2, 2) == (1, 512)
  assert blocks(40, 128, 128, 512, 2, 2) == (20, 128)
  with pytest.raises(ValueError, match='blocks of 8192 rows and 512 tokens do not fit'):
    blocks(1, 128, 8192, 512, 2, 2)
  flops, hbm = pair_sums.cost((2, 20480, 2048), (2, 160, 4096), 2, 2, (2, 1024))
  assert flops == 2 * 2 * (2 * 160 * 4096) * (2 * 2048)  # two products over B x T
  # y's half once, both row blocks once per grid block, accumulators in and sums out
  assert hbm == 2 * 2048 * 2 * 4096 * 2 + 2 * (2 * 160 * 2048 * 2) * 4 + 4 * 2 * 160 * 4096 * 2


@pytest.mark.parametrize('p, q, by_p, parallel', [
    (24, 128, True, (2, 1)),     # 12 heads a half, which fit one block: two of 6
    (1, 256, False, (1, 1)),     # one head of 128 columns a half: nothing to split
    (1, 1024, False, (1, 2))])   # 512 columns a half, which fit one block: two of 256
def test_the_grid_has_a_parallel_axis_of_two_wherever_the_shapes_allow(p, q, by_p, parallel):
  # On v4 and v5p Mosaic splits a kernel between the chip's two TensorCores only along a
  # parallel grid axis of 2 or more; the grid as the TPU lowering writes it (for the TPU,
  # here on the CPU), its blocks of P' and columns parallel, tokens summed.
  rows = 512 if q == 1024 else 160
  xt = jax.ShapeDtypeStruct((2, 4 * rows, 1024), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((p, 2, 1024, q), jnp.bfloat16)
  acc = jax.ShapeDtypeStruct((p // 2, rows, q) if by_p else (p, rows, q // 2), jnp.bfloat16)
  call = lambda *a: pair_sums.pair_sums(*a, 0, 1, half=1, interpret=False)
  text = jax.jit(call).trace(xt, y, acc, acc).lower(lowering_platforms=('tpu',)).as_text()
  grid = hlo_text.mosaic_grid(re.search(r'body\\22: \\22([A-Za-z0-9+/=]+)', text).group(1))
  assert grid.bounds == parallel + (2, 2) and grid.parallel == (True, True, False, False)
  assert kernels.cores_used(grid, 2) == (2 if max(parallel) > 1 else 1)


def test_the_planner_knows_where_the_kernels_blocks_do_not_fit_vmem():
  # decided when the ring is planned (decision._kernel_problem), not when it is traced: a
  # ring whose columns have no 128-wide tile and whose whole rows overflow VMEM runs no
  # kernel, with the reason in its schedule
  assert pair_sums.vmem_problem(8, 512, 1024, 2, 1024, 8, 2, 2, 2) == ''
  problem = pair_sums.vmem_problem(8, 512, 1024, 2, 3000, 8, 0, 2, 2)
  assert problem == ('blocks of 128 rows and 512 tokens do not fit '
                     f'{pair_sums.VMEM_BUDGET} bytes of VMEM')
