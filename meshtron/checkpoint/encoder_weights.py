"""Released weights that a model's input encoders start from, loaded after initialisation.

An input encoder names a folder of released weights (``InputEncoder.pretrained``, from its
config section); the loader for its input's name reads that folder into it, each rank its own
slices. A text model has no encoders and loads nothing. The rest of the model stays as
initialised from the seed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtron.checkpoint.hf_vision import load_hf_vision
from meshtron.config.kinds import VISION
from meshtron.models.transformer import Transformer

ENCODER_LOADERS: dict[str, Callable[[Path, Any], None]] = {VISION: load_hf_vision}
"""Per input name, how its encoder reads released weights (a policy's: a SigLIP tower)."""


def load_pretrained_encoders(model: Transformer) -> None:
    """Fill this rank's input encoders that name released weights from them."""
    for name, encoder in model.input_encoders().items():
        if encoder.pretrained:
            ENCODER_LOADERS[name](Path(encoder.pretrained).expanduser(), encoder)
