r"""MaxText's 64B model on TPU v5p-128 (64 chips): a calibration row.

MaxText measured 70.31% MFU for it (MaxText/configs/v5p/README.md, command in
MaxText/configs/v5p/64b.sh: global_parameter_scale=64, per_device_batch_size=3,
ici_tensor_parallelism=4, remat_policy=minimal, attention='flash'). MaxText's
scale 64 is its base model (embed 2048, 16 heads, MLP 7168, 16 layers) with each
of the four scaled 4x: the 32B row's layer twice as many times, at half its
sequences per chip.

Compiled, as every row, with XLA's windowed einsum at its default threshold, which windows
this program's projections (rings of [1, 512, 7168] weight blocks over ``fsdp`` and of
[12, 512, 8192] activation blocks over ``tensor``), at 2 sequences per chip, not MaxText's
3: a program that does not fit a chip cannot run on one (``maxtext.get_config``). At 3 ours
needs 97.2 GiB per chip, above the 95.74 GiB usable, and the compiler, short of memory,
schedules every one of the 16,854 windowed collective-permutes with its done directly after
its start, nothing computed between: the step model, reading that schedule, finds 2.57 s a
step waiting on them and 49.1% MFU. At 2 the program needs 74.0 GiB and fits, and the
compiler schedules compute between the start and done of every permute: 0.23 s exposed, 64.5%
MFU. MaxText's run fit its chips (it ran), with its own program's memory; its throughput, 323
TFLOP/s a chip as the 32B's 328 on the same slice and layout, is that of the overlapped
schedule. (An earlier version of this row turned windowing off instead, a compiler flag
MaxText did not set.)

Differences from MaxText's run that remain: those listed in
configs/calibration/maxtext_32b_v5p.py (a sequence-parallel residual
stream, synthetic tokens instead of iota embeddings).
"""

from configs.calibration import maxtext


def get_config():
  return maxtext.get_config(d_model=8192, heads=64, mlp=28672, layers=64,
                            topology='v5p:4x4x4', fsdp=16, tensor=4, batch_per_chip=2,
                            remat='minimal', measured_mfu=0.7031)
