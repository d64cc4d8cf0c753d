r"""MaxText's 128B model on TPU v5e-256 (256 chips), FSDP 16 x tensor 16: a calibration row
whose tensor-parallel einsums the compiler may run as rings (XLA's windowed einsum).

MaxText measured 110 TFLOP/s a chip, 56.06% MFU (its v5e README table since commit
9bc243c95, 2023-10-27; command in MaxText/configs/largest_job/128b.sh then:
global_parameter_scale=128, per_device_batch_size=1, ici_fsdp_parallelism=16,
ici_tensor_parallelism=16, remat_policy=full, enable_flash_attention=true;
configs/calibration/SOURCES.md 1B quotes both). Scale 128 of that base.yml: d_model 10240,
64 heads of 256, MLP 65536, 64 layers. The only public measured row with a 16-way tensor
axis on one 16-long ring of the torus; the source does not say whether the compiler
windowed its einsums. The shared settings and the differences that remain are
``maxtext.get_v5e_config``'s (SwiGLU of the same weights within 0.2%, the splash kernel,
synthetic tokens, today's compiler).

Not a default row: our program cannot reproduce it (``benchmarks.calibrate.NOT_REPRODUCED``
says why, with the numbers; docs/calibration.md shows them).
"""

from configs.calibration import maxtext


def get_config():
  return maxtext.get_v5e_config(d_model=10240, heads=64, mlp=65536, layers=64, fsdp=16,
                                tensor=16, batch_per_chip=1, measured_mfu=0.5606)
