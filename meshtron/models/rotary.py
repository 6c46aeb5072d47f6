"""Rotary position embeddings, with the frequency scalings long-context models use.

The inverse frequencies follow ``transformers``' rope init functions operation by operation
(``modeling_rope_utils``: default, linear, llama3, yarn), so imported models reproduce their
logits; yarn's attention factor multiplies the cos/sin tables as it does there.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtron.config.sections import RopeConfig

PLAIN = RopeConfig()


def inverse_frequencies(head_dim: int, theta: float, rope: RopeConfig,
                        max_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention factor) of rotary scaling ``rope``;
    ``max_len`` stands in for an unset ``rope.original_max_len``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    factor = rope.factor
    if rope.scaling == "none":
        return inv_freq, 1.0
    if rope.scaling == "linear":
        return inv_freq / factor, 1.0
    original = rope.original_max_len or max_len
    if rope.scaling == "llama3":
        return _llama3(inv_freq, rope, original), 1.0
    return _yarn(head_dim, theta, rope, original)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, original: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend
    between."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, rope: RopeConfig,
          original: int) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts): dimensions rotating fast are kept, slow ones interpolated by
    ``factor``, a linear ramp between; cos/sin scaled by the attention factor."""
    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class Rotary(nn.Module):
    """Rotary position embedding: the half-split convention of HF Llama, or DeepSeek's
    ``interleaved`` pairs (x0, x1), (x2, x3), ... each turned by one frequency, returned as
    transformers returns them: the even results, then the odd ones (queries and keys are
    permuted alike, so their products are those of the interleaved rotation).

    ``local_theta``: the layers with a sliding window rotate by their own plain table of that
    base (Gemma 3's local layers), reached through :meth:`for_layer`; one module holds both
    tables, so the model passes one rotary to every block."""

    def __init__(self, head_dim: int, max_len: int, theta: float, rope: RopeConfig = PLAIN,
                 interleaved: bool = False, local_theta: float | None = None):
        super().__init__()
        self.interleaved = interleaved
        self.local = (Rotary(head_dim, max_len, local_theta, interleaved=interleaved)
                      if local_theta is not None else None)
        # On the CPU even inside ``torch.device("meta")`` (a checkpoint's shape check): meta's
        # division runs through a Python reference that imports torch._dynamo, ~1.5 s of CPU
        # per process; the tables are not parameters and not saved, so nothing else changes.
        with torch.device("cpu"):
            inv_freq, attention_factor = inverse_frequencies(head_dim, theta, rope, max_len)
            angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def for_layer(self, windowed: bool) -> Rotary:
        """The table of a layer with a sliding window (``windowed``) or without."""
        return self.local if windowed and self.local is not None else self

    def forward(self, x: torch.Tensor, start: int = 0,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape [b, heads, s, head_dim] for positions start..start+s-1, or
        for explicit ``positions`` [b, s]."""
        if positions is None:
            s = x.shape[-2]
            cos, sin = self.cos[start : start + s], self.sin[start : start + s]
        else:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.interleaved:
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin
