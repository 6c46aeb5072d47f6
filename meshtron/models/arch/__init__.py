"""The registry of architectures: each is described once, in its own module, and adding one is
a new module plus an entry here.

``model.arch`` names the block spec (llama, gpt2, gemma3); a model with latent attention
(``model.attention=mla``) takes its architecture's ``latent`` entry (a llama with it is
DeepSeek, with or without experts), else a model with routed experts its ``experts`` entry
(a llama with experts is Mixtral-style).
Hugging Face families built from the same blocks are attached here as variants: Qwen3, Qwen2
and Mistral to llama, Qwen3-MoE to the Mixtral-style entry.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from meshtron.config import ModelConfig
from meshtron.config.checks import choice
from meshtron.models.arch.deepseek import DEEPSEEK
from meshtron.models.arch.gemma3 import GEMMA3
from meshtron.models.arch.gpt2 import GPT2
from meshtron.models.arch.llama import LLAMA
from meshtron.models.arch.mixtral import MIXTRAL
from meshtron.models.arch.qwen import QWEN2_FORMAT, QWEN3_FORMAT
from meshtron.models.arch.qwen_moe import QWEN3_MOE_FORMAT
from meshtron.models.architecture import Architecture, HFFormat, HFModelType

ARCHITECTURES = MappingProxyType({a.name: a for a in (
    dataclasses.replace(LLAMA, hf_variants=(QWEN3_FORMAT, QWEN2_FORMAT, *LLAMA.hf_variants),
                        latent=DEEPSEEK.name),
    dataclasses.replace(MIXTRAL, hf_variants=(QWEN3_MOE_FORMAT,)),
    DEEPSEEK,
    GPT2,
    GEMMA3,
)})
CONFIG_ARCHS = ("llama", "gpt2", "gemma3")
"""The values ``model.arch`` takes (an entry reached through ``experts`` is not one)."""
REFUSED_HF_TYPES = MappingProxyType({
    "qwen2_moe": "its shared expert has a sigmoid gate, which meshtron does not compute",
    "gemma3": "the multimodal Gemma3ForConditionalGeneration; its text-only "
              "Gemma3ForCausalLM, model_type gemma3_text, converts",
})
"""Hugging Face model types refused with a reason (every other unknown type is refused too)."""


def architecture_of(cfg: ModelConfig) -> Architecture:
    """The architecture a model of ``cfg`` is built and converted as."""
    choice(str(cfg.arch), CONFIG_ARCHS, "model.arch")
    arch = ARCHITECTURES[cfg.arch]
    if cfg.latent_attention and arch.latent:  # experts or not: only the MLP changes
        return ARCHITECTURES[arch.latent]
    return ARCHITECTURES[arch.experts] if cfg.is_moe and arch.experts else arch


def hf_model_types() -> dict[str, tuple[HFFormat, HFModelType]]:
    """Every Hugging Face ``model_type`` meshtron reads, with its family."""
    return {t.name: (fmt, t) for arch in ARCHITECTURES.values()
            for fmt in arch.hf_formats() for t in fmt.model_types}
