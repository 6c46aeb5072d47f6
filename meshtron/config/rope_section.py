"""The ``model.rope`` section: rotary frequency scaling for context extension."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RopeConfig:
    """Rotary frequency scaling for context extension (``model.rope.*``), computed as
    ``transformers``' rope init functions do; ``scaling=none`` keeps plain rotary."""

    scaling: str = "none"
    """How rotary frequencies are rescaled: none, linear (positions / factor), llama3
    (Llama 3.1's band-wise scaling) or yarn (NTK-by-parts with an attention factor)."""
    factor: float = 1.0
    """Context extension factor (linear, llama3, yarn)."""
    original_max_len: int | None = None
    """Positions of the original pre-training context (llama3, yarn); None: max_seq_len."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths beyond original_max_len / this are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_len / this are kept; between the two bands the
    scaling is interpolated."""
    beta_fast: float = 32.0
    """yarn: rotations below which dimensions start being interpolated."""
    beta_slow: float = 1.0
    """yarn: rotations below which dimensions are fully interpolated."""
    attention_factor: float | None = None
    """yarn: multiplier of the rotary cos/sin tables (so of attention logits, squared); None:
    0.1 * ln(factor) + 1, the YaRN paper's value."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions (transformers' default)."""
    mscale_all_dim: float = 0.0
    """Latent attention with rope scaling (DeepSeek): the softmax scale is multiplied by
    (0.1 * mscale_all_dim * ln(factor) + 1)^2; 0 keeps 1 / sqrt(query-key width)."""
