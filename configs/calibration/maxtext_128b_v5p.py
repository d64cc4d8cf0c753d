r"""MaxText's 128B model on TPU v5p-256 (128 chips): a calibration row.

MaxText measured 68.68% MFU for it (MaxText/configs/v5p/README.md, command in
MaxText/configs/v5p/128b.sh: global_parameter_scale=128, per_device_batch_size=1,
ici_tensor_parallelism=8, remat_policy=minimal, attention='flash').

Differences from MaxText's run that remain: those listed in
configs/calibration/maxtext_32b_v5p.py (a sequence-parallel residual
stream, synthetic tokens instead of iota embeddings).
"""

from configs.calibration import maxtext


def get_config():
  return maxtext.get_config(d_model=8192, heads=128, mlp=57344, layers=64,
                            topology='v5p:4x4x8', fsdp=16, tensor=8, batch_per_chip=1,
                            remat='minimal', measured_mfu=0.6868)
