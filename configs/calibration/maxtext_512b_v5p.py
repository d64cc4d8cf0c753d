r"""MaxText's 512B model on TPU v5p-1024 (512 chips): a calibration row.

MaxText measured 63.99% MFU for it (MaxText/configs/v5p/README.md, command in
MaxText/configs/v5p/512b.sh: global_parameter_scale=512, per_device_batch_size=2,
ici_tensor_parallelism=8, remat_policy=full, attention='flash').

Differences from MaxText's run that remain: those listed in
configs/calibration/maxtext_32b_v5p.py (a sequence-parallel residual
stream, synthetic tokens instead of iota embeddings).
"""

from configs.calibration import maxtext


def get_config():
  return maxtext.get_config(d_model=16384, heads=128, mlp=57344, layers=128,
                            topology='v5p:8x8x8', fsdp=64, tensor=8, batch_per_chip=2,
                            remat='full', measured_mfu=0.6399)
