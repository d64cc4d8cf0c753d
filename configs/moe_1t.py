r"""A ~1T-parameter Mixture-of-Experts decoder on 1024 TPU v4 chips.

About 1.015T parameters, 66B of them multiplied per token: 64 scanned blocks,
d_model 8192, 64 query heads of 128 over 8 key/value heads; every second block's
MLP is 64 SwiGLU experts of width 19456 (top-2, capacity factor 1.25), the
others dense SwiGLU 32768. Mesh fsdp=8 x tensor=8 x expert=16 on a v4:8x8x16
slice, global batch 1024 x 1024 tokens. Each expert's capacity slots are split
over tensor: the all-to-all moves only a device's own slots, and the rings
decompose the experts' gathers and reduce-scatters over tensor; the tensor axis
is also what lets rings decompose the dense layers (docs/paper_scale.md). Nothing
here runs on a CPU; compile it for the slice ahead of time (the tpu extra):

  python -m launch.aot --config configs/moe_1t.py --topology v4:8x8x16

Its figures, and what each setting below gave: docs/benchmarks.md, docs/paper_scale.md.
"""

import ml_collections

from configs import paper_base


def get_config() -> ml_collections.ConfigDict:
  c = paper_base.get_config()  # bf16 on fp32 weights, scan, splash, fused projections, v4
  c.batch_size = 1024
  c.seq_len = 1024
  c.model.d_model, c.model.num_layers, c.model.mlp_dim = 8192, 64, 32768
  c.model.num_heads, c.model.num_kv_heads = 64, 8
  c.model.remat = 'save_dot_except_qkv'  # 'minimal' does not fit in v4's memory
  c.model.cast_in_loop = True      # one (dense + MoE) unit per iteration, cast inside it
  c.optimizer.learning_rate = 1e-4
  c.moe.num_experts, c.moe.top_k, c.moe.every, c.moe.mlp_dim = 64, 2, 2, 19456
  c.moe.capacity_factor = 1.25
  c.moe.overlap_chunks = 1         # capacity is split over tensor: no chunks
  c.parallelism.plan = paper_base.plan_path('moe_1t')  # launch.aot --tune's (configs/plans/)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = 1, 8, 8, 16
  # Tokens over fsdp and expert (expert last: one all-to-all reaches the experts), the
  # residual stream's sequence and each expert's capacity slots over tensor; expert
  # weights: exp over expert, embed over fsdp, mlp over tensor; dense weights: embed over
  # fsdp and expert, the rest over tensor.
  c.mesh.logical_axis_rules = [
      ['batch', ['data', 'fsdp', 'expert']], ['batch', ['data', 'fsdp']],
      ['residual_length', 'tensor'], ['exp', 'expert'], ['capacity', 'tensor'],
      ['embed', ['fsdp', 'expert']], ['embed', 'fsdp'], ['vocab', 'tensor'],
      ['mlp', 'tensor'], ['heads', 'tensor'], ['kv_heads', 'tensor']]
  c.aot.topology = 'v4:8x8x16'
  return c
