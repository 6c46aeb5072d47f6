"""The attention core every path ends in: softmax(q k^T / sqrt(d)) v over whole sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SDPA_GQA = torch.__version__ >= "2.5"
"""``scaled_dot_product_attention`` takes ``enable_gqa`` (shares kv heads without copies)."""


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, dropout: float = 0.0) -> torch.Tensor:
    """q [b, heads, s, d] over k, v [b, kv_heads, t, d]: causal unless an explicit boolean
    ``mask`` (True = attend) is given; kv heads shared by heads / kv_heads queries each."""
    gqa = {}
    if k.shape[1] != q.shape[1]:
        # Measured on CPU only: on GPUs which kernels take GQA depends on dtype and torch
        # version (fp32 may fall back to the math kernel), so they keep the copies.
        if _SDPA_GQA and q.device.type == "cpu":
            gqa = {"enable_gqa": True}
        else:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=mask is None and q.shape[-2] > 1,
                                          dropout_p=dropout, **gqa)
