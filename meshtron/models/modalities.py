"""The decoder's input encoders, chosen by the model's kind.

Each kind of model (:mod:`meshtron.config.kinds`) maps to a builder of the encoders its
decoder holds on its first stage, one per named input the kind reads; a text model holds none.
Adding a modality is an encoder class (an :class:`~meshtron.models.input_encoder.InputEncoder`)
and an entry here, not a branch in the decoder.
"""

from __future__ import annotations

from collections.abc import Callable

from meshtron.config import ModelConfig
from meshtron.config.kinds import STATE, TEXT, VISION, VLA, model_kind
from meshtron.models.input_encoder import InputEncoder
from meshtron.models.state_encoder import StateEncoder
from meshtron.models.vision import VisionEncoder
from meshtron.parallel.tensor.layers import TPRegion

EncoderBuilder = Callable[[ModelConfig, TPRegion], dict[str, InputEncoder]]


def _no_encoders(cfg: ModelConfig, region: TPRegion) -> dict[str, InputEncoder]:
    return {}


def _vision_encoder(cfg: ModelConfig, region: TPRegion) -> dict[str, InputEncoder]:
    """The ViT, projector and readout token of a vision-language-action policy (and its
    proprioceptive state's token when ``model.vision.state_dims`` is set)."""
    encoders: dict[str, InputEncoder] = {
        VISION: VisionEncoder(cfg.vision, cfg.hidden_size, region, cfg.vocab_size)}
    if cfg.vision.state_tokens:
        encoders[STATE] = StateEncoder(cfg.vision, cfg.hidden_size, region)
    return encoders


ENCODER_BUILDERS: dict[str, EncoderBuilder] = {TEXT: _no_encoders, VLA: _vision_encoder}
"""Per model kind, the builder of its decoder's input encoders (keyed by input name)."""


def build_input_encoders(cfg: ModelConfig, region: TPRegion) -> dict[str, InputEncoder]:
    """The input encoders of a model of ``cfg``, by the name of the input each reads (in the
    order of the kind's ``inputs``, the order they are placed in)."""
    kind = model_kind(cfg)
    encoders = ENCODER_BUILDERS[kind.name](cfg, region)
    assert tuple(encoders) == kind.inputs, (kind, tuple(encoders))
    return encoders
