"""The ``generation`` section: a model's own sampling defaults, kept with its weights.

``meshtron generate`` and ``meshtron serve`` sample with these unless a flag (or a request
field) says otherwise. They travel in the config, so every checkpoint of a run carries them:
``meshtron convert`` fills them from a Hugging Face folder's ``generation_config.json`` (and
writes them into the imported checkpoint and its ``train.yaml``), training keeps them, and
exporting writes them back as ``generation_config.json``. A model meshtron trains from
scratch keeps the defaults below (sampling at temperature 0.8, top-k 50, top-p 0.95), which
its exported ``generation_config.json`` then states, so transformers samples alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtron.errors import MeshtronError

SOURCES = ("meshtron", "generation_config.json", "config.json", "none")


@dataclass
class GenerationConfig:
    """Sampling defaults of the model (``generation.*``), as Hugging Face's generation config
    states them; ``meshtron generate`` and ``meshtron serve`` use them unless told otherwise."""

    do_sample: bool = True
    """Sample (with temperature, top_k, top_p); false: greedy decoding, transformers' default
    for a model whose generation config says nothing."""
    temperature: float = 0.8
    """Softmax temperature when sampling (a model's file without one: 1.0, as transformers)."""
    top_k: int = 50
    """Keep the k most likely tokens when sampling; 0 keeps all (transformers' default 50)."""
    top_p: float = 0.95
    """Keep the smallest set of tokens whose probability reaches top_p when sampling; 1 keeps
    all (transformers' default 1.0)."""
    max_new_tokens: int | None = None
    """New tokens per prompt that `meshtron generate` defaults to; None: its own default (100)."""
    max_length: int | None = None
    """Prompt plus new tokens as the model's file states it; kept for export, not applied
    (meshtron budgets new tokens: max_new_tokens)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id as the model's file states it (kept for export)."""
    eos_token_id: list[int] | None = None
    """End-of-sequence ids as the model's file states them (kept for export; generation stops at
    the tokenizer's end-of-text token)."""
    pad_token_id: int | None = None
    """Padding id as the model's file states it (kept for export)."""
    source: str = "meshtron"
    """Where these came from: meshtron (its defaults for a model it trained, or what a user
    set), generation_config.json or config.json (an imported model's file), or none (an
    imported model that states nothing: greedy, as transformers)."""

    @property
    def greedy(self) -> bool:
        """Whether the model's default is greedy decoding."""
        return not self.do_sample or self.temperature == 0


def check_generation(g: GenerationConfig) -> None:
    """Each field on its own, one sentence per problem."""
    if g.source not in SOURCES:
        raise MeshtronError(f"generation.source must be one of {', '.join(SOURCES)}, got "
                            f"{g.source!r}")
    if not (math.isfinite(g.temperature) and g.temperature >= 0):
        raise MeshtronError(f"generation.temperature must be a finite number >= 0, got "
                            f"{g.temperature}")
    if g.top_k < 0:
        raise MeshtronError(f"generation.top_k must not be negative (0 keeps all), got {g.top_k}")
    if not (math.isfinite(g.top_p) and 0 < g.top_p <= 1):
        raise MeshtronError(f"generation.top_p must lie in (0, 1] (1 keeps all), got {g.top_p}")
    for name in ("max_new_tokens", "max_length"):
        value = getattr(g, name)
        if value is not None and value < 0:
            raise MeshtronError(f"generation.{name} must not be negative, got {value}")
