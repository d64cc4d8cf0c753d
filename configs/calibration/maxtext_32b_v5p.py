r"""MaxText's 32B model on TPU v5p-128 (64 chips): a calibration row.

MaxText measured 71.47% MFU for it (MaxText/configs/v5p/README.md, command in
MaxText/configs/v5p/32b.sh: global_parameter_scale=32, per_device_batch_size=7,
ici_tensor_parallelism=4, remat_policy=minimal, attention='flash'). This config
reproduces its shape so ``python -m benchmarks.calibrate`` can compare the
step model's modeled MFU of our compiled program with that measurement.

Differences from MaxText's run that remain (the model is checked against
MaxText's measured number all the same; each is a reason the two programs'
step times can differ):
* batch: 5 sequences per chip (global 320), not MaxText's 7. A program that does not fit
  a chip cannot run on one, so each row runs at MaxText's batch or, where our program
  needs more memory than a chip gives one, the largest batch at which it fits
  (``maxtext.get_config``). At 7 the TPU compiler refuses our program (100.3 GiB of
  temporaries against 95.74 GiB usable, with the splash kernel); at 6 it compiles to
  99.4 GiB per chip (``memory_analysis()``), above the usable figure; at 5 it needs 84.4
  GiB and fits. The batch moves the modeled MFU little: 65.16% at 6, 65.08% at 5;
* sharding: our residual stream is sequence-parallel over ``tensor`` where
  MaxText shards its embed dimension over ``tensor``;
* MaxText feeds iota embeddings (``use_iota_embed``) and reuses one example
  batch; we read synthetic tokens (neither changes the step's FLOPs);
* no bias, dropout or z-loss differences matter to the step time; our
  optimizer is AdamW with fp32 moments as MaxText's.
"""

from configs.calibration import maxtext


def get_config():
  return maxtext.get_config(d_model=8192, heads=64, mlp=28672, layers=32,
                            topology='v5p:4x4x4', fsdp=16, tensor=4, batch_per_chip=5,
                            remat='minimal', measured_mfu=0.7147)
