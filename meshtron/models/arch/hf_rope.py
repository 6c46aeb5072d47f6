"""Rotary settings of Hugging Face config files, both ways: ``rope_parameters``
(transformers 5) or ``rope_scaling`` (older files) to :class:`RopeConfig`, and back.

Read as ``transformers`` reads them (``modeling_rope_utils``): a type's required keys, its
defaults, ``original_max_position_embeddings`` at the top level winning over the one inside,
yarn's factor from the context ratio when unset and its attention factor from ``mscale`` /
``mscale_all_dim`` when given. Types meshtron does not compute are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

from meshtron.config import ModelConfig
from meshtron.config.sections import RopeConfig
from meshtron.models.architecture import HFConfig

SCALINGS = ("linear", "llama3", "yarn")


def _number(hf: HFConfig, params: dict[str, Any], key: str, default: Any = None) -> Any:
    value = params.get(key, default)
    if value is None:
        return None
    hf.require(isinstance(value, (int, float)) and not isinstance(value, bool)
               and math.isfinite(value), f"rope parameter '{key}' must be a number, got {value!r}")
    return value


def _original(hf: HFConfig, params: dict[str, Any], max_pos: int) -> int:
    """The pre-training context: a top-level field first (as transformers), else the one in
    the rope parameters, else max_position_embeddings."""
    value = hf.raw.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", max_pos))
    hf.require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
               f"original_max_position_embeddings must be a positive integer, got {value!r}")
    return value


def read_rope(hf: HFConfig, default_theta: float, max_pos: int) -> tuple[float, RopeConfig]:
    """(rope_theta, rope scaling) of an HF config; what meshtron cannot compute is refused."""
    params = hf.raw.get("rope_parameters") or hf.raw.get("rope_scaling") or {}
    hf.require(isinstance(params, dict), f"rope_parameters must be a mapping, got {params!r}")
    hf.require(not any(isinstance(v, dict) for v in params.values()),
               "per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    hf.require(rope_type in ("default", *SCALINGS), f"rope scaling '{rope_type}' is not "
               "supported (meshtron computes default, linear, llama3 and yarn)")
    partial = params.get("partial_rotary_factor", hf.raw.get("partial_rotary_factor", 1.0))
    hf.require(partial == 1.0, f"partial_rotary_factor={partial} is not supported")
    theta = float(_number(hf, params, "rope_theta", hf.raw.get("rope_theta", default_theta)))
    if rope_type == "default":
        return theta, RopeConfig()
    factor = _number(hf, params, "factor")
    if rope_type == "linear":
        hf.require(factor is not None, "rope scaling 'linear' needs a 'factor'")
        return theta, RopeConfig(scaling="linear", factor=float(factor))
    original = _original(hf, params, max_pos)
    original_max_len = None if original == max_pos else original  # None: max_seq_len
    if rope_type == "llama3":
        keys = {k: _number(hf, params, k) for k in ("factor", "low_freq_factor",
                                                    "high_freq_factor")}
        for key, value in keys.items():
            hf.require(value is not None, f"rope scaling 'llama3' needs '{key}'")
        return theta, RopeConfig(scaling="llama3", factor=float(factor),
                                 original_max_len=original_max_len,
                                 low_freq_factor=float(keys["low_freq_factor"]),
                                 high_freq_factor=float(keys["high_freq_factor"]))
    factor = max_pos / original if factor is None else factor
    attention = _number(hf, params, "attention_factor")
    mscale, mscale_all = _number(hf, params, "mscale"), _number(hf, params, "mscale_all_dim")
    if attention is None and mscale and mscale_all:
        def get_mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        attention = get_mscale(mscale) / get_mscale(mscale_all)
    truncate = params.get("truncate", True)
    hf.require(isinstance(truncate, bool), f"rope parameter 'truncate' must be true or false, "
               f"got {truncate!r}")
    return theta, RopeConfig(
        scaling="yarn", factor=float(factor), original_max_len=original_max_len,
        beta_fast=float(_number(hf, params, "beta_fast") or 32),
        beta_slow=float(_number(hf, params, "beta_slow") or 1),
        attention_factor=None if attention is None else float(attention), truncate=truncate)


def rope_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields of ``cfg``'s rotary scaling (none when it is plain)."""
    rope = cfg.rope
    if rope.scaling == "none":
        return {}
    params: dict[str, Any] = {"rope_type": rope.scaling, "rope_theta": cfg.rope_theta,
                              "factor": rope.factor}
    if rope.scaling in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = rope.original_max_len or cfg.max_seq_len
    if rope.scaling == "llama3":
        params.update(low_freq_factor=rope.low_freq_factor,
                      high_freq_factor=rope.high_freq_factor)
    if rope.scaling == "yarn":
        params.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                      truncate=rope.truncate)
        if rope.attention_factor is not None:
            params["attention_factor"] = rope.attention_factor
    return {"rope_parameters": params}
