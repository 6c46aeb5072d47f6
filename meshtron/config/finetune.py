"""Optimisation defaults for continuing from pretrained weights (fine-tuning), which
``meshtron convert`` writes into the ``train.yaml`` of every imported model.

The ``train`` section's own defaults are for training from scratch: a peak learning rate of
3e-3 after a 20-step warm-up suits a freshly initialised tiny model, but on pretrained weights
(with fresh AdamW moments, since an imported checkpoint holds none) the same steps undo what
the model knew: fine-tuning a 135M-parameter Llama with them raised its loss from 4.75 to 5.44
in 20 steps. The values here follow what fine-tuning recipes use for small models:

* peak learning rate 3e-5: TRL's ``SFTConfig`` defaults to 2e-5 for full fine-tuning and
  Megatron-style full SFT recipes use 1e-5 to 5e-5; 3e-5 sits inside that range for models of
  0.1-1B parameters, 100x below the from-scratch peak;
* a 10-step linear warm-up (5% of the default 200 steps, as ``lr_warmup_fraction 0.05`` in
  Megatron SFT recipes): long enough for AdamW's second moments to settle before the peak;
* cosine decay to 10% of the peak (``min_lr`` = lr / 10, Megatron's convention);
* no weight decay (TRL / transformers' ``TrainingArguments`` default): decay pulls the weights
  towards zero, not towards the pretrained ones, and a short run has nothing to regularise.

Each is an ordinary ``train.*`` value in the file: a user changes it there or overrides it on
the command line (``--train.lr=1e-4``), and the trainer's start-up line says which were used.
"""

from __future__ import annotations

from typing import Any

FINETUNE_TRAIN: dict[str, Any] = {"lr": 3e-5, "min_lr": 3e-6, "warmup_steps": 10,
                                  "weight_decay": 0.0}
"""The ``train.*`` values an imported model's ``train.yaml`` starts with."""
