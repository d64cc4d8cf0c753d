r"""A ~1T-parameter Mixture-of-Experts decoder on 1024 TPU v4 chips.

About 1.015T parameters, 66B of them multiplied per token: 64 scanned blocks,
d_model 8192, 64 query heads of 128 over 8 key/value heads; every second block's
MLP is 64 SwiGLU experts of width 19456 (top-2, capacity factor 1.25), the
others dense SwiGLU 32768; vocabulary 32768. Mesh fsdp=8 x tensor=8 x expert=16
on a v4:8x8x16 slice: four experts live on each expert-axis slice, their
weights sharded over fsdp (embed) and tensor (mlp); dense weights are sharded
over fsdp and expert (embed) and tensor (heads, mlp), with the residual stream
sequence-parallel over tensor. Global batch 1024 x 1024 tokens, bf16 compute
over fp32 master weights and AdamW state (from dense_500b), remat
save_dot_except_qkv, one (dense + MoE) unit per scan iteration, each unit's
weights cast to bf16 inside the scan (model.cast_in_loop).

Each expert's 40 capacity slots are split over tensor (5 per device): the
all-to-all moves only a device's own slots, and the experts' einsums gather the
slots over tensor before gate/up and reduce-scatter them after down, which
rings decompose. With the slots whole on every tensor device instead, each of
them sends the same tokens (8x the all-to-all bytes) and the down projection's
partial sums need an all-reduce of every slot (docs/paper_scale.md). A split
capacity dim keeps the exchange single (a chunk of slots would span devices).

The tensor axis is what lets rings decompose the dense layers. Without it
(fsdp=16 x expert=64) every dense weight is sharded over all 1024 chips, and the
compiler gathers and reduces such weights with synchronous all-reduces (2.56 s
per step, modeled; docs/paper_scale.md).

Nothing here runs on this machine's CPU; compile it for the TPU slice ahead of
time (needs the tpu extra):

  python -m launch.aot --config configs/moe_1t.py --topology v4:8x8x16

The modeled seconds in the comments below compare layouts and settings with one
another; they were modeled before the step model's calibration refits of
2026-12-04 (matmuls then at the data sheet's peak, now at 87% of it).
Today's figures for this config: docs/benchmarks.md.
"""

import ml_collections

from configs import dense_500b


def get_config() -> ml_collections.ConfigDict:
  c = dense_500b.get_config()  # bf16 compute, scan, optimizer, tpu_v4
  # Keep every projection's output but q/k/v's (the backward pass recomputes no MLP), one
  # (dense + MoE) unit per scan iteration, each unit's weights cast inside the scan: the
  # compiler's bf16 copy of all layers' weights (1.84 GiB per chip) does not fit beside the
  # MLP outputs (modeled, ours: 3.504 s at 30.12 GiB per chip; with the copy, remat
  # 'save_dot_except_mlp' and two units per iteration, 3.892 s at 29.88 GiB; 'minimal'
  # 3.531 s at 31.32 GiB does not fit; docs/paper_scale.md). Since the layers' gradients
  # stay bf16, the copy fits (at today's constants: ours 3.745 s at 28.30 GiB, against
  # 3.725 s at 26.47 cast inside the scan).
  c.model.remat = 'save_dot_except_qkv'
  c.model.scan_unroll = 1
  c.model.cast_in_loop = True
  c.batch_size = 1024
  c.seq_len = 1024

  c.model.d_model = 8192
  c.model.num_layers = 64
  c.model.num_heads = 64
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 32768

  c.moe.num_experts = 64
  c.moe.top_k = 2
  c.moe.every = 2
  c.moe.mlp_dim = 19456
  c.moe.capacity_factor = 1.25
  c.moe.overlap_chunks = 1  # capacity is split over tensor: no chunks
  # Tight on memory: no weight-gradient ring over tensor whose accumulator holds the
  # gradient whole over fsdp (with them, 'any': 32.16 GiB per chip of 30.75 usable; 29.88;
  # with the gradients in bf16 it fits, 29.11 GiB, but is slower: 3.802 s at today's
  # constants).
  c.parallelism.gradient_accumulators = 'sharded'
  # Four ring steps per loop iteration: a ring of 8 has every bidirectional round in one
  # iteration (modeled, ours 3.504 s at 30.12 GiB; 2: 3.536 s; 1: 3.620 s; 8: as 4).
  c.parallelism.unroll = 4
  # dense_500b's bf16 moments, ring steps, block layout and ring schedule are for its
  # memory and layout
  c.optimizer.mu_dtype = 'param'
  c.optimizer.nu_dtype = 'param'
  c.parallelism.block_layout = 'compiler'
  c.parallelism.last_contribution = 'fused'
  c.parallelism.weight_gradient_gather = 'beside'
  c.parallelism.ring_additions = 'fused'  # 3.713 -> 3.590 s (configs/dense_64b.py)
  # Two-way all-gather rings (the experts' above all) run an einsum a block: their pairs'
  # joins and splits go (compute 2.688 -> 2.650 s, within 5% of the baseline's), and the
  # expert exchange waits about as much longer (3.590 -> 3.591 s; modeled, v4).
  c.parallelism.gather_pairs = 'apart'
  # The chip's flags only: the 500B's ICI pipelining leaves every variant's step unchanged.
  c.hardware.xla_flags = 'default'

  c.mesh.data = 1
  c.mesh.fsdp = 8
  c.mesh.tensor = 8
  c.mesh.expert = 16
  # Tokens over fsdp and expert (expert last: one all-to-all reaches the experts), the
  # residual stream's sequence over tensor, each expert's capacity slots over tensor;
  # expert weights: exp over expert, embed over fsdp, mlp over tensor; dense weights:
  # embed over fsdp and expert, the rest over tensor.
  c.mesh.logical_axis_rules = [
      ['batch', ['data', 'fsdp', 'expert']],
      ['batch', ['data', 'fsdp']],
      ['residual_length', 'tensor'],
      ['exp', 'expert'],
      ['capacity', 'tensor'],
      ['embed', ['fsdp', 'expert']],
      ['embed', 'fsdp'],
      ['vocab', 'tensor'],
      ['mlp', 'tensor'],
      ['heads', 'tensor'],
      ['kv_heads', 'tensor'],
  ]
  return c
