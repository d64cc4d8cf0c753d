r"""A ~500B-parameter dense decoder (Llama-style) on 1024 TPU v4 chips.

496.3B parameters: 100 scanned blocks, d_model 20480, 160 query heads of 128
over 16 key/value heads, SwiGLU 65536, vocabulary 32768, untied embeddings.
Mesh fsdp=128 x tensor=8 on a v4:8x8x16 slice, global batch 256 x 2048
tokens, bf16 compute over fp32 master weights, both AdamW moments in bf16,
remat minimal (every projection's output kept), two layers
per scan iteration with each layer's weights cast inside the scan, every weight
gradient ringed over fsdp (``parallelism.gradient_accumulators='sharded'``),
two ring steps per loop iteration, the rings' sliced operands and accumulators
laid out for them (``parallelism.block_layout``), the forward rings' own
contributions apart (``parallelism.last_contribution``), attn.qkv's weight-gradient
input gathered first (``parallelism.weight_gradient_gather``), the activation rings'
partial sums added inside their einsums and the weight gradients' two-way rings a Pallas
kernel a round (``parallelism.ring_additions``), the two-way
all-gather rings an einsum a block (``parallelism.gather_pairs``), splash attention,
fused q/k/v and gate/up projections, XLA's collective pipelining over ICI on top of
the chip's flags (``hardware.xla_flags``).
The paper (Wang et al., ASPLOS 2023) reports 72% of peak FLOPS for a 500B
model on 1024 TPU v4 chips.

Nothing here runs on this machine's CPU; compile it for the TPU slice ahead of
time (needs the tpu extra) and read memory fit and the modeled step time:

  python -m launch.aot --config configs/dense_500b.py --topology v4:8x8x16

Expect FITS and three modeled variants (see docs/benchmarks.md).

The modeled seconds in the comments below compare layouts and settings with one
another; those not said to be at today's constants were modeled before the step
model's calibration refits of 2026-12-04 (matmuls then at the data sheet's peak,
now at 87% of it).
Today's figures for this config: docs/benchmarks.md.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.steps = 100_000            # the LR schedule's length (AOT compiles one step)
  c.batch_size = 256           # sequences: 2 per fsdp shard
  c.seq_len = 2048
  c.log_every = 10
  c.eval_every = 1000
  c.eval_steps = 8

  c.model.vocab_size = 32768
  c.model.d_model = 20480
  c.model.num_layers = 100
  c.model.num_heads = 160
  c.model.num_kv_heads = 16
  c.model.head_dim = 128
  c.model.mlp_dim = 65536
  c.model.max_seq_len = 2048
  c.model.norm_eps = 1e-5
  c.model.dtype = 'bfloat16'       # compute
  c.model.param_dtype = 'float32'  # master weights (and AdamW moments)
  c.model.scan_layers = True       # one compiled block, not 100
  # Every projection's output kept ('minimal': the backward pass recomputes no projection),
  # two layers per scan iteration (the second layer's weight gathers overlap the first's
  # backward; with one, the backward waits 0.19 s a step for mlp.down's gather over fsdp)
  # and each layer's weights cast inside the scan (no bf16 copy of all layers' weights).
  # Fits with the weight-gradient rings of parallelism.gradient_accumulators='sharded'
  # (below): 30.74 GiB per chip of 30.75 (modeled, ours 8.017 s, baseline 9.016 s, before
  # the ring settings and bf16 moments below). The
  # layout before, remat 'save_dot_except_qkv' with one layer per iteration and the
  # compiler's casts: ours 8.254 s, baseline 9.446 s, slower for every variant
  # (docs/paper_scale.md). The layout search ranks this layout first (its memory estimate,
  # 29.5 GiB with the bf16 moments below, 31.3 GiB with fp32 ones, within the search's
  # margin; launch/search.py).
  c.model.remat = 'minimal'
  c.model.scan_unroll = 2
  c.model.cast_in_loop = True
  c.model.attention = 'splash'     # the Pallas splash kernel, as MaxText on TPU
  c.model.fused_projections = True  # one einsum (and one ring) for q/k/v, one for gate/up

  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 2000
  c.optimizer.weight_decay = 0.1
  # Both AdamW moments in bf16 (MaxText's mu_dtype, and optimizer.nu_dtype; DeepSeek-V3
  # keeps both moments in bf16), each 0.9 GiB per chip less: the room the ring settings
  # below need (with fp32 moments they need 31.2 GiB of the 30.75; with the first moment
  # in bf16 alone 30.96 GiB since the last two). The master weights stay fp32. The
  # optimizer's update with them: tests/test_trainer.py.
  c.optimizer.mu_dtype = 'bfloat16'
  c.optimizer.nu_dtype = 'bfloat16'

  c.data.path = 'synthetic'        # point at real tokens (.npy/.bin) to train

  c.mesh.data = 1
  # tensor=8 (MaxText's choice for 512B on v5p): each ring step's einsum is twice as wide
  # as at tensor=16 for the same 512-token block, so it hides the block's transfer
  # (modeled faster than fsdp=64 x tensor=16; docs/paper_scale.md)
  c.mesh.fsdp = 128
  c.mesh.tensor = 8

  # 'auto': the cost model (tpu_v4 profile) decides per layer.
  c.parallelism.collective_matmul = 'auto'
  # Every weight gradient rings over fsdp: none accumulates whole over fsdp before the
  # compiler's reduce-scatter (the attention's did, under 'any': 31.09 GiB per chip here,
  # which does not fit; docs/paper_scale.md).
  c.parallelism.gradient_accumulators = 'sharded'
  # Two ring steps per loop iteration (the loop's block copies and some additions go), each
  # weight-gradient ring's activation operand laid out for its blocks where it is made (the
  # compiler copied it whole once a layer: 0.11 s a step; and since, the reduce-scatter
  # rings' activation accumulators as their einsums write them), the forward reduce-scatter
  # rings' own contributions computed while their last accumulators travel, and attn.qkv's
  # weight-gradient operand gathered before its data gradient's ring (the two had queued
  # on the tensor links: 0.060 s a step exposed). Modeled, v4: ours 7.998 s with one ring
  # step an iteration and fp32 moments; 7.808 s with the first two (and the unembedding
  # plain, for memory); 7.756 s with the last two and a bf16 second moment; 7.755 s with
  # the unembedding ringed again; 7.746 s with the accumulators' layout (docs/paper_scale.md,
  # Recent changes). The reduce-scatter rings with activation outputs add their partial
  # sums inside their einsums, each accumulator in two halves that take turns: 0.130 s a
  # step of additions go, 7.603 s (7.680 s with the one-way rings' alone).
  c.parallelism.unroll = 2
  c.parallelism.block_layout = 'contiguous'
  c.parallelism.last_contribution = 'apart'
  c.parallelism.weight_gradient_gather = 'before'
  # ... and each round of the weight gradients' bidirectional rings over fsdp is one Pallas
  # kernel for both directions (parallelism/pair_sums.py): their activation read once a
  # round, both accumulators added as the products are written, no pair copied out of the
  # activation: 7.597 -> 7.284 s, compute 1.104x -> 1.046x the baseline's (modeled, v4).
  c.parallelism.ring_additions = 'kernel'
  # Two-way all-gather rings run an einsum a block, no join and split of each pair:
  # 7.603 -> 7.597 s (modeled, v4).
  c.parallelism.gather_pairs = 'apart'

  c.hardware.name = 'tpu_v4'
  # The chip's flags (MaxText's), then XLA's pipelining of a scanned layer's all-gathers
  # and reduce-scatters over ICI into the iteration before (after): the first projection's
  # weight gather no longer waits at the top of each iteration. As MaxText's recent
  # recipes; every variant compiles with them (modeled, v4: baseline 8.863 -> 8.578 s,
  # ours 7.773 -> 7.496 s; also --xla_tpu_enable_ici_ar_pipelining=true: ours 7.626 s;
  # docs/paper_scale.md).
  c.hardware.xla_flags = ('default --xla_tpu_enable_ici_ag_pipelining=true '
                          '--xla_tpu_enable_ici_rs_pipelining=true')

  c.aot = ml_collections.ConfigDict()
  c.aot.topology = 'v4:8x8x16'     # the slice launch.aot compiles for (--topology overrides)
  return c
