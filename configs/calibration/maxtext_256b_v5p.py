r"""MaxText's 256B model on TPU v5p-1024 (512 chips): a calibration row.

MaxText measured 67.09% MFU for it (MaxText/configs/v5p/README.md, command in
MaxText/configs/v5p/256b.sh: global_parameter_scale=256, per_device_batch_size=1,
ici_tensor_parallelism=8, remat_policy=minimal, attention='flash'). MaxText's
scale 256 is its base model (embed 2048, 16 heads, MLP 7168, 16 layers) with
embed, heads and MLP scaled 8x and layers 4x: the 512B row's slice, mesh and layer
widths at half its layers and half its sequences per chip. The model is furthest
from this row's measurement (docs/calibration.md; docs/paper_scale.md).

Differences from MaxText's run that remain: those listed in
configs/calibration/maxtext_32b_v5p.py (a sequence-parallel residual
stream, synthetic tokens instead of iota embeddings).
"""

from configs.calibration import maxtext


def get_config():
  return maxtext.get_config(d_model=16384, heads=128, mlp=57344, layers=64,
                            topology='v5p:8x8x8', fsdp=64, tensor=8, batch_per_chip=1,
                            remat='minimal', measured_mfu=0.6709)
