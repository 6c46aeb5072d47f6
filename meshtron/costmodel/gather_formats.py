"""What ZeRO-3's parameter gather moves under ``precision.fp8_param_gather``.

With the setting, the gather sends the FP8 blocks' linear weights as E4M3 (one byte an element)
and the NVFP4 blocks' as E2M1 (half a byte), everything else (kept blocks, norms, biases,
embeddings, the output layer, routers and routed experts) in ``precision.dtype``
(:mod:`meshtron.optim.fp8_gather`). Before the gathers agree their scales, one all-reduce
(max) carries an fp32 amax per FP8 weight and per 16 x 16 tile of an NVFP4 weight, once per
change of the shards (once a step). ZeRO 1/2's post-update gather stays in the dtype, as the
product's does. Priced per rank of a pipeline stage, its tensor-parallel slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import ModelConfig, PrecisionConfig
from meshtron.models.arch import architecture_of
from meshtron.models.flops import mlp_matmul_params
from meshtron.precision.recipes import layer_format

FORMAT_BYTES = {"fp8": 1.0, "fp4": 0.5}
"""Bytes an element of a low-precision weight takes in the gather."""
TILE = 16 * 16
"""Elements of an NVFP4 weight tile, each with one fp32 amax in the all-reduce."""
AMAX_BYTES = 4


def gather_formats(pc: PrecisionConfig, cfg: ModelConfig) -> tuple[str, ...]:
    """Each block's (multi-token-prediction blocks included) gather format, ``high``, ``fp8``
    or ``fp4``; empty when the setting is off (everything in the dtype)."""
    if not pc.fp8_param_gather:
        return ()
    return tuple(layer_format(pc, cfg.num_layers, i)
                 for i in range(cfg.num_layers + cfg.mtp_depth))


def linear_weights(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(elements, tensors) of block ``layer``'s linear weights that precision.fp8/fp4 cover:
    the attention projections and the dense (or shared-expert) MLP; not routed experts,
    the router, norms or biases."""
    arch = architecture_of(cfg)
    # q, kv, proj; latent attention: q (or q_a, q_b), kv_a, kv_b, proj
    tensors = (2 if cfg.q_lora_rank else 1) + 3 if cfg.latent_attention else 3
    ffn = cfg.ffn_hidden_size
    if cfg.is_moe_layer(layer):
        ffn = cfg.moe.shared_experts * cfg.moe.expert_ffn_size
    mlp = mlp_matmul_params(cfg, ffn) if ffn else 0
    return arch.attention.matmul_params(cfg) + mlp, tensors + (2 if ffn else 0)


@dataclass(frozen=True)
class LowPrecisionGather:
    """One rank's low-precision share of its stage's dense gather."""

    elements: float
    """Elements that travel in FP8 or FP4 (this tp rank's slices)."""
    bytes: float
    """What those elements take in the gather."""
    amax_bytes: float
    """The amax all-reduce's payload (one fp32 per FP8 weight and per NVFP4 tile)."""


def low_precision_gather(cfg: ModelConfig, formats: tuple[str, ...], layers: list[int],
                         tp: int) -> LowPrecisionGather:
    """The low-precision part of the gather of one tp rank holding blocks ``layers``."""
    elements = size = amaxes = 0.0
    for layer in layers:
        fmt = formats[layer] if layer < len(formats) else "high"
        if fmt not in FORMAT_BYTES:
            continue
        count, tensors = linear_weights(cfg, layer)
        elements += count / tp
        size += count / tp * FORMAT_BYTES[fmt]
        amaxes += tensors if fmt == "fp8" else count / tp / TILE
    return LowPrecisionGather(elements, size, amaxes * AMAX_BYTES)
