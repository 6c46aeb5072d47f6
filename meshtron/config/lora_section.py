"""The ``model.lora`` section: low-rank adapters (LoRA, Hu et al. 2021) on a frozen model.

A rank above 0 adds to each targeted linear layer ``W`` a pair ``B A`` of rank ``rank``
(``A``: rank x in, ``B``: out x rank, B starting at zero so the adapted model starts as the
base) scaled by ``alpha / rank``, as PEFT's ``LoraConfig`` does; every other parameter is
frozen and only the adapters are trained, reduced, kept in the optimizer and checkpointed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtron.errors import MeshtronError

ATTENTION_TARGETS = ("q", "kv", "proj")
"""The attention projections (queries, [keys | values], output)."""
LATENT_TARGETS = ("q_a", "q_b", "kv_a", "kv_b")
"""Latent attention's own (``model.attention=mla``): the query down and up projections (or
``q`` when ``q_lora_rank`` is 0), the latent down-projection with its rotary key part and the
latent up-projection to the heads' keys and values; its output projection is ``proj``."""
MLP_TARGETS = ("gate_up", "up", "down")
"""The dense MLP's projections (and the shared experts' of an MoE layer)."""
EXPERT_TARGET = "experts"
"""Every routed expert's [gate | up] and down products, each expert its own adapters (the
shared experts are a dense MLP: ``mlp``)."""
TARGET_GROUPS = {"attention": ATTENTION_TARGETS + LATENT_TARGETS, "mlp": MLP_TARGETS}
"""Names standing for several projections."""
BASE_DTYPES = ("bf16", "fp16", "fp32")


@dataclass
class LoraConfig:
    """Low-rank adapters (``model.lora.*``); ``rank`` 0 (the default) trains the whole model."""

    rank: int = 0
    """Rank of each adapter; 0: no adapters (every parameter trains)."""
    alpha: float = 16.0
    """Adapter scale numerator: the update B A is multiplied by alpha / rank (PEFT's)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps runs layout-independent)."""
    targets: list[str] | None = None
    """Projections that get adapters: attention (q, kv, proj; latent attention's q or q_a
    and q_b, kv_a, kv_b, proj), mlp (gate_up or up, down), experts (every routed expert's) or
    those names one by one; None: attention and mlp."""
    base_dtype: str | None = None
    """dtype the frozen base projections are held in (bf16 halves their memory; they compute
    in precision.dtype); None: precision.dtype."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def target_names(self) -> frozenset[str]:
        """The projections' attribute names the adapters attach to."""
        names: set[str] = set()
        for target in self.targets or ("attention", "mlp"):
            names.update(TARGET_GROUPS.get(target, (target,)))
        return frozenset(names)


def check_lora(lora: LoraConfig) -> None:
    """The section on its own: bounds and known names (what the model has is the plan's)."""
    if lora.rank < 0:
        raise MeshtronError(f"model.lora.rank must not be negative, got {lora.rank}")
    if not lora.enabled:
        return
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise MeshtronError(f"model.lora.alpha must be a positive number, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise MeshtronError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    known = (*TARGET_GROUPS, *ATTENTION_TARGETS, *LATENT_TARGETS, *MLP_TARGETS, EXPERT_TARGET)
    for target in lora.targets or ():
        if target not in known:
            raise MeshtronError(f"model.lora.targets has unknown '{target}'; choose from "
                                f"{', '.join(known)}")
    if lora.targets is not None and not lora.targets:
        raise MeshtronError("model.lora.targets is empty: name at least one projection")
    if lora.base_dtype is not None and lora.base_dtype not in BASE_DTYPES:
        raise MeshtronError(f"model.lora.base_dtype must be one of {', '.join(BASE_DTYPES)}, "
                            f"got {lora.base_dtype}")


def lora_widths(m: Any) -> dict[str, int]:
    """Each projection's smaller side (of one part, for the fused ones) in ``m`` (a resolved
    ModelConfig): no adapter may have a larger rank. Only projections some block has."""
    h, d = m.hidden_size, m.head_size
    widths = {"q": min(h, m.num_heads * d), "kv": min(h, m.num_kv_heads * d),
              "proj": min(h, m.num_heads * d)}
    if m.attention == "mla":
        widths = latent_widths(m)
    ffns = [m.ffn_hidden_size] if not all(m.is_moe_layer(i) for i in range(m.num_layers)) else []
    if m.is_moe and m.moe.shared_experts:
        ffns.append(m.moe.shared_experts * (m.moe.expert_ffn_size or m.ffn_hidden_size))
    if ffns:
        widths.update(dict.fromkeys(MLP_TARGETS, min(h, *ffns)))
    if m.is_moe:
        widths[EXPERT_TARGET] = min(h, m.moe.expert_ffn_size or m.ffn_hidden_size)
    return widths


def latent_widths(m: Any) -> dict[str, int]:
    """Latent attention's projections' smaller sides: ``q`` or ``q_a`` and ``q_b``, ``kv_a``
    (latent and rotary key), ``kv_b`` (every head's keys and values), ``proj``."""
    h, heads, q_rank, kv_rank = m.hidden_size, m.num_heads, m.q_lora_rank, m.kv_lora_rank
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    widths = {"q_a": min(h, q_rank), "q_b": min(q_rank, heads * qk)} if q_rank \
        else {"q": min(h, heads * qk)}
    widths.update(kv_a=min(h, kv_rank + m.qk_rope_head_dim),
                  kv_b=min(kv_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                  proj=min(h, heads * m.v_head_dim))
    return widths


def check_lora_run(cfg: Any) -> None:
    """What the adapters need from the rest of the config: targets the model has, a rank no
    larger than any targeted projection, no overlapped tp communication (its fused products
    bypass the layers)."""
    m, lora = cfg.model, cfg.model.lora
    if not lora.enabled:
        return
    widths = lora_widths(m)
    targeted = {name: widths[name] for name in lora.target_names() if name in widths}
    if not targeted:
        raise MeshtronError(f"model.lora.targets={','.join(lora.targets or ())} names no "
                            "projection this model has (an MoE model without shared experts "
                            "has no dense MLP, a dense model no experts); target attention")
    name, width = min(targeted.items(), key=lambda item: item[1])
    if lora.rank > width:
        raise MeshtronError(f"model.lora.rank={lora.rank} is larger than the {name} "
                            f"projection's smaller side ({width}); use a rank of at most "
                            f"{width}")
    if cfg.parallel.tp_comm_overlap:
        raise MeshtronError("model.lora.rank > 0 cannot run with parallel.tp_comm_overlap "
                            "(its fused products bypass the adapters); turn the overlap off")
