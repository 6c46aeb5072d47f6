"""What kind of model a config describes: the named inputs it reads besides tokens and
whether its loss counts every token.

The kind is the key of the registries that differ by modality: the data builder
(:mod:`meshtron.data.builders`) and the decoder's input encoders
(:mod:`meshtron.models.modalities`). A layer that needs to know what a model reads asks here
instead of testing the model's sections itself; a new modality is a new kind here and an entry
in each registry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshtron.config.sections import ModelConfig

TEXT = "text"
"""A language model: token windows in, next tokens out."""
VLA = "vla"
"""A vision-language-action policy: a camera frame, an instruction and action tokens."""
VISION = "vision"
"""The input name of a vision-language-action policy's camera frames (uint8 [b, H, W, C])."""
STATE = "state"
"""The input name of a policy's proprioceptive state (float [b, model.vision.state_dims]), read
only when ``model.vision.state_dims`` is set."""


@dataclass(frozen=True)
class ModelKind:
    name: str
    inputs: tuple[str, ...] = ()
    """Names of the model inputs besides token ids, in the order the decoder places them:
    each is read by the decoder's input encoder of that name (its submodule and parameter
    prefix) and produced under that name when the kind's batch rows are unpacked."""
    masked_targets: bool = False
    """Windows mark the tokens that are read but never predicted (targets below 0), so the
    loss counts the others only."""


KINDS: dict[str, ModelKind] = {
    TEXT: ModelKind(TEXT),
    VLA: ModelKind(VLA, inputs=(VISION,), masked_targets=True),
}


def model_kind(model: ModelConfig) -> ModelKind:
    """The kind of ``model`` (one of :data:`KINDS`; a policy that reads the proprioceptive
    state is the ``vla`` kind with that input too, so the registries keyed by the kind's name
    serve it)."""
    kind = KINDS[VLA if model.vision.enabled else TEXT]
    if model.vision.state_tokens:
        kind = replace(kind, inputs=(*kind.inputs, STATE))
    return kind
