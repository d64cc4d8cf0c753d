r"""What MaxText's measured TPU runs share: its v5p rows (MaxText/configs/v5p/*.sh) in
``get_config``, its v4 and v5e rows of 2023 in ``get_2023_config`` and the two after it.

Every v5p row: sequence length 2048, vocabulary 32000, head_dim 128, as many
key/value heads as query heads, SwiGLU, untied embeddings, bf16 compute over
fp32 weights and AdamW moments, each layer weight's gradient converted to fp32
inside the layer as MaxText's casts do (``model.grads_in_param_dtype``; ours keep
them bf16 until the optimizer, which changes the scanned program: 64B's row is
modeled 4.5 points higher with them bf16), synthetic data, layers scanned, the splash
attention kernel (MaxText's ``attention='flash'`` on a TPU is the same Pallas
kernel, with blocks of 512, its ``sa_block_*`` defaults), MaxText's XLA
flags (the ``tpu_v5p`` row of parallelism/hardware.py), and XLA's windowed
einsum at its default threshold: ``python -m benchmarks.calibrate`` compiles
the ``xla`` variant of launch.aot, what MaxText ran. The files beside this one
are the rows; each names its measured MFU and the differences that remain.

Each row runs at its source's batch, or, where our program needs more memory than a chip
gives one, at the largest batch at which it fits: a program that does not fit a chip cannot
run on one, and the compiler schedules one that does not fit otherwise (it may leave no
transfer overlapped: configs/calibration/maxtext_64b_v5p.py). No row sets a compiler flag
its source did not set.

``aot.measured_mfu`` is the published measurement a row is checked against
(``--config.aot.measured_mfu`` sets it for another published shape), and
``aot.measured_attention`` how it counted attention FLOPs.
"""

import ml_collections

from configs import default

def get_config(*, d_model: int, heads: int, mlp: int, layers: int, topology: str, fsdp: int,
               tensor: int, batch_per_chip: int, remat: str,
               measured_mfu: float) -> ml_collections.ConfigDict:
  c = default.get_config()
  chips = fsdp * tensor
  c.steps = 100_000
  c.batch_size = batch_per_chip * chips
  c.seq_len = 2048
  c.model.vocab_size = 32000
  c.model.d_model = d_model
  c.model.num_layers = layers
  c.model.num_heads = heads
  c.model.num_kv_heads = heads
  c.model.head_dim = 128
  c.model.mlp_dim = mlp
  c.model.max_seq_len = 2048
  c.model.dtype = 'bfloat16'
  c.model.param_dtype = 'float32'
  c.model.scan_layers = True
  c.model.grads_in_param_dtype = True  # MaxText's fp32 gradients, stacked by the scan
  c.model.remat = remat
  c.model.attention = 'splash'
  c.model.attention_block = 512
  c.data.path = 'synthetic'
  c.mesh.data = 1
  c.mesh.fsdp = fsdp
  c.mesh.tensor = tensor
  c.parallelism.collective_matmul = 'never'  # the xla variant: XLA's windowed einsum
  c.hardware.name = 'tpu_v5p'
  c.aot = ml_collections.ConfigDict()
  c.aot.topology = topology
  c.aot.measured_mfu = measured_mfu  # MaxText/configs/v5p/README.md, one slice
  # MaxText's MFU then counted every (query, key) pair of causal attention (before its PR
  # #1988, docs/reference/performance_metrics.md there); benchmarks.calibrate compares our
  # model with it over our count, each pair once: 71.47% is 70.29% of ours at 32B.
  c.aot.measured_attention = 'full'
  return c


def get_2023_config(*, d_model: int, heads: int, mlp: int, layers: int, topology: str,
                    fsdp: int, tensor: int, batch_per_chip: int, seq_len: int,
                    measured_mfu: float) -> ml_collections.ConfigDict:
  """What MaxText's rows of 2023 share (its TPU v4 and v5e README tables): the base.yml of
  that time, which differs from the v5p rows' (configs/calibration/SOURCES.md sections 1A
  and 1B): vocabulary 32768, head_dim 256, a single ReLU up-projection of width ``mlp``
  (here SwiGLU of width 2/3 ``mlp``, rounded up to a multiple of 128 where 3 does not
  divide it: the same weights and matmul FLOPs, within 0.2%), tied embeddings, remat
  'full'. Each chip's rows add their attention, compiler flags and FLOP count."""
  c = get_config(d_model=d_model, heads=heads, mlp=-(-2 * mlp // 3 // 128) * 128 if mlp % 3
                 else 2 * mlp // 3, layers=layers, topology=topology, fsdp=fsdp, tensor=tensor,
                 batch_per_chip=batch_per_chip, remat='full', measured_mfu=measured_mfu)
  c.seq_len = seq_len
  c.model.max_seq_len = seq_len
  c.model.vocab_size = 32768
  c.model.head_dim = 256
  c.model.tie_embeddings = True
  return c


def get_v4_config(*, d_model: int, heads: int, mlp: int, layers: int, topology: str,
                  fsdp: int, batch_per_chip: int,
                  measured_mfu: float) -> ml_collections.ConfigDict:
  """MaxText's TPU v4 rows of April 2023 (its v4 README table; commands in
  MaxText/configs/1xv4-128.sh and 1xv4-384.sh then): ``get_2023_config`` at sequence
  length 1024, pure FSDP over ``fsdp`` chips, plain XLA attention (no flash kernel then),
  and the one compiler flag those commands set. Its TFLOP/s counted 6 x parameters a
  token, no attention (``measured_attention='none'``). Differences that remain: SwiGLU for
  its ReLU MLP, synthetic tokens, and today's compiler (libtpu 0.0.42) where MaxText ran
  2023's, whose own defaults have moved since; each row names its batch."""
  c = get_2023_config(d_model=d_model, heads=heads, mlp=mlp, layers=layers, topology=topology,
                      fsdp=fsdp, tensor=1, batch_per_chip=batch_per_chip, seq_len=1024,
                      measured_mfu=measured_mfu)
  c.model.attention = 'xla'
  c.hardware.name = 'tpu_v4'
  # LIBTPU_INIT_ARGS of those commands: this flag, and TPU_MEGACORE=MEGACORE_DENSE, which is
  # how the v4 slice runs here already (one device a chip)
  c.hardware.xla_flags = '--xla_enable_async_all_gather=true'
  c.aot.measured_attention = 'none'
  return c


# LIBTPU_INIT_ARGS of MaxText's v5e commands (MaxText/configs/largest_job/*.sh, 2023-10-27)
V5E_FLAGS = ('--xla_tpu_enable_data_parallel_all_reduce_opt=true '
             '--xla_tpu_data_parallel_opt_different_sized_ops=true '
             '--xla_tpu_enable_async_collective_fusion=true '
             '--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true '
             '--xla_tpu_enable_async_collective_fusion_multiple_steps=true '
             '--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true')


def get_v5e_config(*, d_model: int, heads: int, mlp: int, layers: int, fsdp: int, tensor: int,
                   batch_per_chip: int, measured_mfu: float) -> ml_collections.ConfigDict:
  """MaxText's TPU v5e rows of October 2023 on one v5e-256 (its v5e README table; commands
  in MaxText/configs/largest_job/*.sh then): ``get_2023_config`` at sequence length 2048,
  its flash attention kernel (the splash kernel here), and those commands' compiler flags.
  Its MFU counted every (query, key) pair of attention (``measured_attention='full'``)."""
  c = get_2023_config(d_model=d_model, heads=heads, mlp=mlp, layers=layers,
                      topology='v5e:16x16', fsdp=fsdp, tensor=tensor,
                      batch_per_chip=batch_per_chip, seq_len=2048, measured_mfu=measured_mfu)
  c.hardware.name = 'tpu_v5e'
  c.hardware.xla_flags = V5E_FLAGS
  return c
