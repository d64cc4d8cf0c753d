r"""Fine-tuning: the default run, with the model and parameters of a checkpoint.

  python -m trainer.train --config configs/finetune.py:CHECKPOINT --workdir runs/finetune

CHECKPOINT is one of our checkpoints: a run's workdir (its newest checkpoint),
a step directory, or what ``python -m trainer.convert hf-import`` wrote. The
model config is read from it, ``init_from`` points at it (parameters only: the
optimizer state and step start fresh), the tokenizer is the checkpoint's
(``data.tokenizer``: the file ``hf-import`` copied, or the run's own), and the
optimizer is set for fine-tuning (lower peak learning rate, short warmup).
Everything else is ``configs/default.py``; override as usual, e.g.
``--config.data.path=my_texts/*.txt`` (tokenized with that tokenizer) or
``--config.data.path=tokens.npy`` for token ids.
"""

from configs import default
from trainer import checkpoint, tokenizer


def get_config(path: str = ''):
  if not path:
    raise ValueError('configs/finetune.py needs a checkpoint: --config configs/finetune.py:PATH')
  c = default.get_config()
  try:
    model = checkpoint.peek_model_config(path)
  except checkpoint.CheckpointError as e:
    raise ValueError(str(e)) from None
  for key, value in model.items():
    if key in c.model:
      c.model[key] = value
  for key, value in model.get('moe', {}).items():
    c.moe[key] = value
  c.init_from = path
  c.data.tokenizer = tokenizer.for_checkpoint(path)
  c.steps = 200
  c.optimizer.learning_rate = 3e-4  # a tenth of pre-training's
  c.optimizer.warmup_steps = 20
  return c
