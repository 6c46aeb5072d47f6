"""The registry of architectures: each is described once, in its own module, and adding one is
a new module plus an entry here.

``model.arch`` names the block spec (llama, gpt2); a model with routed experts takes its
architecture's ``experts`` entry where it has one (a llama with experts is Mixtral-style).
"""

from __future__ import annotations

from types import MappingProxyType

from meshtron.config import ModelConfig
from meshtron.config.checks import choice
from meshtron.models.arch.gpt2 import GPT2
from meshtron.models.arch.llama import LLAMA
from meshtron.models.arch.mixtral import MIXTRAL
from meshtron.models.architecture import Architecture, HFModelType

ARCHITECTURES = MappingProxyType({a.name: a for a in (LLAMA, MIXTRAL, GPT2)})
CONFIG_ARCHS = ("llama", "gpt2")
"""The values ``model.arch`` takes (an entry reached through ``experts`` is not one)."""


def architecture_of(cfg: ModelConfig) -> Architecture:
    """The architecture a model of ``cfg`` is built and converted as."""
    choice(str(cfg.arch), CONFIG_ARCHS, "model.arch")
    arch = ARCHITECTURES[cfg.arch]
    return ARCHITECTURES[arch.experts] if cfg.is_moe and arch.experts else arch


def hf_model_types() -> dict[str, tuple[Architecture, HFModelType]]:
    """Every Hugging Face ``model_type`` meshtron reads, with its architecture."""
    return {t.name: (arch, t) for arch in ARCHITECTURES.values() if arch.hf is not None
            for t in arch.hf.model_types}
