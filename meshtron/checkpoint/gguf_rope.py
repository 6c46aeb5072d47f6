"""Llama 3.1-style rope scaling in GGUF files: the ``rope_freqs.weight`` tensor.

llama.cpp does not store Llama 3.1's rope parameters (factor, low/high frequency factors,
original context); its converter writes one factor per rotary frequency instead, and its rope
divides each base frequency by it. The export writes those factors from meshtron's own
frequencies (:func:`meshtron.models.rotary.inverse_frequencies`: base over scaled). The import
reads the parameters back: the factors between the two bands follow
``1 / f = (1 - s) / factor + s`` with ``s`` linear in 1 / wavelength, which a line through
them gives (taking ``low_freq_factor`` = 1, as Llama 3.x has; any other value gives the same
factors), and they are kept only when meshtron's frequencies from them reproduce every factor.
"""

from __future__ import annotations

import math

import torch

from meshtron.config.sections import RopeConfig
from meshtron.errors import MeshtronError
from meshtron.models.rotary import inverse_frequencies

NAME = "rope_freqs.weight"


def rope_factors(head_dim: int, theta: float, rope: RopeConfig, max_len: int) -> torch.Tensor:
    """llama.cpp's per-frequency divisors of a llama3-scaled rope (base over scaled)."""
    base, _ = inverse_frequencies(head_dim, theta, RopeConfig(), max_len)
    scaled, _ = inverse_frequencies(head_dim, theta, rope, max_len)
    return (base / scaled).to(torch.float32)


def llama3_from_factors(factors: torch.Tensor, head_dim: int, theta: float, max_len: int,
                        where: str) -> dict[str, float | int]:
    """The ``rope_scaling`` (HF config.json form) whose frequencies the file's factors give."""
    refused = MeshtronError(f"{where}: {NAME} holds per-frequency rope factors that are not "
                            "Llama 3.1-style rope scaling, which is all meshtron reads from them")
    if factors.shape != (head_dim // 2,):
        raise refused
    base, _ = inverse_frequencies(head_dim, theta, RopeConfig(), max_len)
    factors = factors.double()
    factor = float(factors.max())
    middle = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor <= 1 or int(middle.sum()) < 2:
        raise refused
    blend = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
    inverse_wavelen = base.double()[middle] / (2 * math.pi)
    slope, intercept = _line(inverse_wavelen, blend)
    if intercept >= 0 or slope <= 0:
        raise refused
    original = round(-slope / intercept)
    factor, high = _tidy(factor), _tidy(1 - 1 / intercept)  # float32 factors: 7 digits
    rope = RopeConfig(scaling="llama3", factor=factor, original_max_len=original,
                      low_freq_factor=1.0, high_freq_factor=high)
    if not torch.allclose(rope_factors(head_dim, theta, rope, max_len).double(), factors,
                          rtol=1e-4, atol=0):
        raise refused
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": original}


def _tidy(value: float) -> float:
    """``value`` to 6 significant digits: 8.0000005 (float32 noise) is 8."""
    return float(f"{value:.6g}")


def _line(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y over x."""
    mean_x, mean_y = x.mean(), y.mean()
    slope = ((x - mean_x) * (y - mean_y)).sum() / ((x - mean_x) ** 2).sum()
    return float(slope), float(mean_y - slope * mean_x)
