"""Which sampling ``meshtron generate`` and ``meshtron serve`` use, and the line saying so.

The defaults are the model's own (its config's ``generation`` section: what an imported
model's ``generation_config.json`` said, greedy when it said nothing, as transformers decodes;
meshtron's temperature 0.8, top-k 50, top-p 0.95 for a model it trained). A flag given on the
command line, or a field of a request, wins over the model for that setting alone. The
start-up line names the result and where each part came from, so a user comparing meshtron's
output with another runtime's sees at once whether both sample, and how.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import GenerationConfig
from meshtron.models.generation import Sampling

DEFAULT_MAX_NEW_TOKENS = 100
"""``generate``'s budget when neither ``--max-new-tokens`` nor the model names one."""


@dataclass(frozen=True)
class SamplingChoice:
    """The sampling to use and the start-up line that says it."""

    sampling: Sampling
    line: str


def end_ids(gen: GenerationConfig, tokenizer_eos: int) -> tuple[int, ...]:
    """The ids that end a completion: the model's own ``eos_token_id`` (one or several; a chat
    model ends its turn with one the tokenizer does not call end-of-text, such as SmolLM2's
    ``<|im_end|>``), as transformers stops at any of them; else the tokenizer's end-of-text."""
    return tuple(gen.eos_token_id) if gen.eos_token_id else (tokenizer_eos,)


def model_sampling(gen: GenerationConfig) -> Sampling:
    """The model's default sampling: temperature 0 (greedy) when it does not sample."""
    return Sampling(0.0 if gen.greedy else gen.temperature, gen.top_k, gen.top_p)


def origin(gen: GenerationConfig) -> str:
    """Where the model's defaults came from, in words."""
    if gen.source == "none":
        return "the imported model states no generation settings: transformers' defaults"
    if gen.source in ("generation_config.json", "config.json"):
        return f"from the model's {gen.source}"
    neutral = GenerationConfig()
    ours = (gen.do_sample, gen.temperature, gen.top_k, gen.top_p) == (
        neutral.do_sample, neutral.temperature, neutral.top_k, neutral.top_p)
    return ("meshtron's defaults for a model it trained" if ours
            else "from the checkpoint's generation.* settings")


def choose_sampling(gen: GenerationConfig, temperature: float | None = None,
                    top_k: int | None = None, top_p: float | None = None,
                    seed: int = 0) -> SamplingChoice:
    """The model's defaults with the settings given on the command line (None: not given)
    put over them."""
    base = model_sampling(gen)
    given = {"temperature": temperature, "top-k": top_k, "top-p": top_p}
    sampling = Sampling(base.temperature if temperature is None else temperature,
                        base.top_k if top_k is None else top_k,
                        base.top_p if top_p is None else top_p, seed)
    return SamplingChoice(sampling, describe(sampling, given, origin(gen)))


def describe(sampling: Sampling, given: dict[str, float | int | None], where: str) -> str:
    """``sampling: ...`` naming each setting, the flag of each one ``given``, and ``where``
    the others came from."""
    def mark(name: str) -> str:
        return f" (--{name})" if given.get(name) is not None else ""

    if sampling.temperature <= 0:
        ignored = [f"--{n}" for n in ("top-k", "top-p") if given.get(n) is not None]
        verb = "apply" if len(ignored) > 1 else "applies"
        note = (f"; {' and '.join(ignored)} {verb} only when sampling (a temperature above 0)"
                if ignored else "")
        return f"sampling: greedy{mark('temperature') or f' ({where})'}{note}"
    parts = [f"temperature {sampling.temperature:g}{mark('temperature')}",
             (f"top-k {sampling.top_k}" if sampling.top_k else "top-k off") + mark("top-k"),
             (f"top-p {sampling.top_p:g}" if sampling.top_p < 1 else "top-p off")
             + mark("top-p")]
    from_model = sum(value is None for value in given.values())
    tail = "" if not from_model else (f" ({where})" if from_model == len(given)
                                     else f"; others: {where}")
    return f"sampling: {', '.join(parts)}{tail}"
