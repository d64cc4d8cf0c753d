r"""Default run: a byte-level LM with 1,117,312 parameters on the embedded corpus.

Run it (what `make train` does):

  python -m trainer.train --config configs/default.py --workdir runs/default

Trains on 8 simulated CPU devices (hardware.name='auto' on a machine without a
TPU or GPU) with mesh data=4 x tensor=2 (sequence-parallel residual stream), in
fp32, on the Python standard library source (see trainer/data.py), with every
dense layer decomposed into a collective einsum. Each eval line shows gzip -9's
and xz -9e's bits per byte on the same held-out bytes (trainer/compression.py);
the last should read about eval_bpb 1.98 (gzip -9 1.851, xz -9e 1.774), after
about 8 minutes on an idle 2-core machine (install excluded; python -m
trainer.data prints the references alone). The model is small and the batch
large for the two cores: 4.3 M tokens through 1.1 M parameters score better
than fewer tokens through a larger model in the same time (README, "What make
train does"); data=4 x tensor=2 runs these steps faster than data=2 x tensor=4.

Every field is documented here; trainer/config.py declares them all with their
types and meanings (--help, configs/README.md). Override any field with
--config.a.b=value.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0                  # seeds parameter init and the data order
  c.steps = 520               # run length, and the length of the LR schedule
  c.stop_after = config_dict.placeholder(int)  # end after this step (as a preemption would)
  c.batch_size = 32           # global batch, in sequences
  c.seq_len = 256             # tokens per sequence (packed)
  c.log_every = 10            # steps between metric records
  c.eval_every = 130          # steps between evals (and an eval at the end)
  c.eval_steps = 4            # eval on this many fixed held-out batches
  c.init_from = ''            # checkpoint to take parameters from (fine-tuning); '' none
  c.on_nonfinite = 'stop'     # loss or grad norm NaN/inf: stop (exit 3) | skip (drop the update)

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 264        # 256 bytes + specials, padded to a multiple of 8
  c.model.d_model = 128           # embed
  c.model.num_layers = 4          # Transformer blocks
  c.model.num_heads = 4           # query heads
  c.model.num_kv_heads = 4        # key/value heads (grouped-query when < num_heads)
  c.model.head_dim = 32           # per head
  c.model.mlp_dim = 512           # SwiGLU hidden width
  c.model.max_seq_len = 1024      # longest sequence the model accepts
  c.model.rope_theta = 10_000.0   # rotary embedding base
  c.model.norm_eps = 1e-6         # RMSNorm epsilon
  c.model.tie_embeddings = False  # share the input embedding with the output layer
  c.model.dtype = 'float32'       # compute dtype (bfloat16 on accelerators)
  c.model.param_dtype = 'float32' # parameter (master weight) dtype
  c.model.scan_layers = False     # jax.lax.scan over layers (compile time of deep models)
  c.model.remat = 'none'          # activation recomputation: none | full | dots (= minimal)
  # xla (whole [t, s] logits) | blockwise (keys in blocks) | splash (Pallas kernel, TPUs) |
  # cudnn (flash attention, NVIDIA GPUs, bf16/fp16) | auto (per platform, recorded in
  # config.json: models/attention.py)
  c.model.attention = 'xla'
  c.model.attention_block = 512   # key positions per block of blockwise and splash attention

  # Mixture of Experts (models/moe.py): num_experts=0 keeps every MLP dense.
  c.moe = ml_collections.ConfigDict()
  c.moe.num_experts = 0            # experts per MoE layer (0: no MoE)
  c.moe.top_k = 2                  # experts each token goes to
  c.moe.every = 1                  # layer i is MoE when (i + 1) % every == 0
  c.moe.mlp_dim = 1024             # each expert's SwiGLU hidden width
  c.moe.capacity_factor = 1.25     # slots per expert = factor x tokens x top_k / experts
  c.moe.dropless = False           # capacity = all tokens of a sequence: nothing dropped
  c.moe.load_balance_weight = 0.01 # Switch/GShard load-balancing loss weight
  c.moe.router_z_weight = 1e-3     # router z-loss weight
  c.moe.overlap_chunks = 2         # chunks of the decomposed expert all-to-all

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 4e-3    # peak learning rate
  c.optimizer.schedule = 'cosine'     # after warmup: cosine | linear | constant | wsd | rsqrt
  c.optimizer.warmup_steps = 30       # linear warmup from 0
  c.optimizer.end_lr_fraction = 0.1   # cosine, linear, wsd decay to this fraction of the peak
  c.optimizer.decay_fraction = 0.2    # wsd: the last 20% of the steps decay (the rest: peak)
  c.optimizer.b1 = 0.9                # AdamW beta1
  c.optimizer.b2 = 0.95               # AdamW beta2
  c.optimizer.eps = 1e-8              # AdamW epsilon
  c.optimizer.mu_dtype = 'param'      # AdamW's first moment: param (weights' dtype) | bfloat16
  c.optimizer.nu_dtype = 'param'      # AdamW's second moment: param | bfloat16
  c.optimizer.weight_decay = 0.1      # decoupled, on matrices only
  c.optimizer.grad_clip = 1.0         # global-norm clip (0 disables)
  c.optimizer.grad_accum_steps = 1    # microbatches per step
  c.optimizer.z_loss = 1e-4           # weight of log(Z)^2 (0 disables)

  # Input data (trainer/data.py, trainer/pipeline.py). Real corpora: prepare them once
  # with python -m trainer.prepare, then name the directory here.
  c.data = ml_collections.ConfigDict()
  c.data.path = ''            # a prepared corpus directory, or several separated by commas (a
                              # mixture) | '' embedded corpus | text file or glob | .npy/.bin
                              # tokens | 'synthetic'
  c.data.weights = ''         # mixture: each corpus's share of the sequences, e.g. '3,1' ('': by size)
  c.data.eval_path = ''       # prepared corpus whose held-out documents evals score ('': data.path's)
  c.data.prefetch = 4         # batches built ahead by a background thread (0: when needed)
  c.data.bin_dtype = 'uint16' # dtype of raw .bin token files: uint16 | uint32
  c.data.eval_fraction = 0.1  # held-out tail of the token stream (sources other than prepared ones)
  # Text tokenizer (trainer/tokenizer.py): '' byte-level | a local tokenizer.json
  # (Hugging Face) | a SentencePiece .model | a directory holding one. Never downloaded.
  c.data.tokenizer = ''

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 4             # data parallel (in-slice); one size may be -1
  c.mesh.fsdp = 1             # fully sharded data parallel
  c.mesh.tensor = 2           # tensor (model) parallel
  c.mesh.expert = 1           # expert parallel
  c.mesh.dcn_data = 1         # across slices (multi-slice); explicit sizes
  c.mesh.dcn_fsdp = 1
  c.mesh.dcn_tensor = 1
  c.mesh.dcn_expert = 1
  # Ordered logical-axis rules: [logical name, mesh axis | [mesh axes] | None].
  c.mesh.logical_axis_rules = [
      ['batch', ['data', 'fsdp']],
      ['residual_length', 'tensor'],  # sequence-parallel residual stream
      ['vocab', 'tensor'],
      ['embed', 'fsdp'],
      ['mlp', 'tensor'],
      ['heads', 'tensor'],
      ['kv_heads', 'tensor'],
      ['exp', 'expert'],
  ]

  c.parallelism = ml_collections.ConfigDict()
  # Decompose every eligible dense layer: on CPU this costs about nothing
  # (python -m benchmarks.train_step) and shows the technique; the default, 'auto', lets
  # the cost model decide per layer (on CPU it decomposes nothing: nothing overlaps).
  # How each ring runs is the planner's (parallelism/schedule.py; the parallelism report
  # shows it): on CPU the simplest ring, on accelerators every refinement that applies.
  c.parallelism.collective_matmul = 'always'    # auto (cost model) | always | never
  # Partial sums on the wire and between ring steps (rings, and the compiler's collectives
  # of plain einsums): compute (the model's dtype; each device adds in fp32) | float32.
  c.parallelism.ring_dtype = 'compute'
  # Layers that run otherwise than collective_matmul says: 'PATTERN=FORM,...', each pattern
  # a layer path as the parallelism report names it (* matches any part), FORM auto | ring |
  # plain | gradients (auto, and a weight gradient may ring alone beside a plain forward).
  c.parallelism.layer_overrides = ''
  # A plan file (a run's WORKDIR/plan.json) to run instead of planning: '' plans (a resume
  # runs its workdir's plan.json); a plan for another model or mesh is refused.
  c.parallelism.plan = ''
  # How each layer's form is chosen: model (the cost model) | measure (its candidate forms
  # timed on the devices before step 1, the fastest kept) | auto (measure on a TPU or GPU).
  c.parallelism.tune = 'auto'

  # Checkpoints go to WORKDIR/checkpoints/<step>; a run started in a workdir that
  # has some resumes from the newest complete one (see trainer/checkpoint.py).
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 130        # steps between saves, plus one at the end and on SIGTERM (0: off)
  c.checkpoint.keep = 3           # most recent checkpoints kept
  c.checkpoint.keep_period = 0    # also keep every step divisible by this (0: none)
  c.checkpoint.async_save = True  # write in the background while training goes on
  c.checkpoint.on_corrupt = 'error'  # error | previous: resume from the newest readable one

  # Multi-process runs (launch/local.py and launch/tpu_pod.py set these up);
  # RINGTRAIN_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID override the first three.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ''  # host:port of process 0 ('' with 1 process: none)
  c.distributed.num_processes = 1
  c.distributed.process_id = 0
  c.distributed.auto = False              # TPU pod workers: let JAX detect everything
  c.distributed.bind_address = ''         # coordinator listens here ('' : the address itself
                                          # when it is loopback, else all interfaces)
  c.distributed.initialization_timeout = 120  # seconds to wait for every process
  c.distributed.heartbeat_timeout = 15    # a silent peer is declared dead after this (s)
  c.distributed.shutdown_timeout = 30     # seconds to wait for peers at exit

  # jax.profiler trace of some steps and the train step's HLO, in WORKDIR/profile
  # (trainer/profiling.py).
  c.profile = ml_collections.ConfigDict()
  c.profile.start_step = 5        # first traced update (0-based: metrics.jsonl calls it step 6)
  c.profile.num_steps = 0         # updates traced (0: no trace)
  c.profile.dump_hlo = False      # write the compiled train step's HLO text

  c.hardware = ml_collections.ConfigDict()
  # Profile (parallelism/hardware.py): auto (detected from the devices: simulated
  # CPU devices when no TPU or GPU is visible) | cpu (the CPU even beside an
  # accelerator) | tpu_v4 | tpu_v5p | tpu_v5e | tpu_v6e | h100 | h200 (must match).
  c.hardware.name = 'auto'
  c.hardware.peak_flops = 0.0     # per-device peak override (0: from the profile)
  c.hardware.cpu_devices = 8      # simulated CPU devices, unless RINGTRAIN_CPU_DEVICES is set
  # Compiler flags for training on a TPU (LIBTPU_INIT_ARGS; also launch.aot) or a GPU
  # (XLA_FLAGS): 'default' (the chip's row in parallelism/hardware.py), 'none', or a
  # space-separated list.
  c.hardware.xla_flags = 'default'
  return c
