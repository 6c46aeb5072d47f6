"""What ``selective`` recompute recomputes, as the software that published runs used defines it.

Two definitions of "selective" activation checkpointing are in use, and they cost differently:

- ``core`` (Megatron-LM's ``--recompute-granularity selective``, Korthikanti et al. 2022): the
  attention core is recomputed in the backward; every product's output is kept. Extra work:
  one forward of the core. This is meshtron's own ``selective``.
- ``ops`` (TorchTitan's ``selective_ac_option = "op"``, ``_save_list`` in its
  ``parallelize_llama.py``): inside each checkpointed block the outputs of the attention
  kernel and of every *odd* ``aten.mm`` in forward order are saved; every second matmul and
  every memory-bound operator (norms, rotary, the activation, casts) is recomputed. A llama
  block's products run q, k, v, o, then the MLP's gate, up, down, so k, o and up are
  recomputed: for Llama 3 8B 37% of the block's product FLOPs, and the attention core none.
- ``layers`` (TorchTitan's ``selective_ac_option = "N"``): every N-th block is checkpointed
  whole (as ``full``), the others keep everything (as ``none``).

:func:`recomputed_gemm_shares` gives the share of each of a layer's GEMMs (in the order of
:func:`meshtron.costmodel.workload.layer_work`) that ``ops`` recomputes; the activation formula
(:mod:`meshtron.costmodel.activations`) counts what it saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshtron.config import ModelConfig
from meshtron.models.arch import architecture_of

if TYPE_CHECKING:
    from meshtron.costmodel.priced import Software

SELECTIVE_STYLES = ("core", "ops", "layers")


def mlp_recomputed_share(cfg: ModelConfig) -> float:
    """The MLP's products run gate, up, down (the 5th-7th matmuls of a block) or up, down (5th,
    6th): the even-numbered one, up or down, is recomputed, a third or a half of the MLP."""
    return 1 / 3 if architecture_of(cfg).gated_mlp else 1 / 2


def recomputed_gemm_shares(cfg: ModelConfig, layer: int) -> tuple[float, ...]:
    """Per GEMM of :func:`~meshtron.costmodel.workload.layer_work` (q/k/v products, the
    output projection, then the MLP's or the router, the experts and the shared experts), the
    share of its FLOPs that TorchTitan's per-op policy recomputes: k of q/k/v (the 2nd matmul,
    its width over q's and two kv's), all of the output projection (the 4th), the MLP's middle
    product. Latent attention's several down- and up-projections alternate: half. A MoE
    layer's router and grouped expert GEMMs are saved (TorchTitan's later save list names
    ``_grouped_mm``), its shared experts alternate like an MLP."""
    if cfg.latent_attention:
        projections = 0.5
    else:
        q, kv = cfg.num_heads, cfg.num_kv_heads
        projections = kv / (q + 2 * kv)
    mlp = mlp_recomputed_share(cfg)
    if not cfg.is_moe_layer(layer):
        return projections, 1.0, mlp
    shared = (mlp,) if cfg.moe.shared_experts else ()
    return (projections, 1.0, 0.0, 0.0) + shared


def recomputed_seconds(recompute: str, software: Software, shares: tuple[float, ...],
                       gemms: list[float], core: float, memory: float) -> float:
    """Forward seconds of one layer that its backward repeats for what the forward dropped:
    all of it under ``full``; under ``selective`` what the software means by it: the
    attention core (``core``), the ``shares`` of the ``gemms`` with every memory-bound
    operator (``ops``), or the whole forward of one block in ``selective_every``
    (``layers``)."""
    forward = sum(gemms) + core + memory
    if recompute == "full":
        return forward
    if recompute != "selective":
        return 0.0
    if software.selective == "ops":
        return memory + sum(share * g for share, g in zip(shares, gemms, strict=True))
    if software.selective == "layers":
        return forward / software.selective_every
    return core
