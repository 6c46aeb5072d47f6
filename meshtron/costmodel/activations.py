"""Activation memory by formula: what one transformer block keeps for backward.

The formula counts the tensors this implementation saves per block and micro-batch (the
analogue of Korthikanti et al.'s 34·sbh + 5·as²b for Megatron's GPT in fp16), with b·s = N
tokens, h hidden, a/t query and k kv heads of size d on this rank, f/t FFN units, in elements:

- each of the two norms: its normalised input, the 1/rms per token, and its output as saved by
  the projections that read it — under sequence parallelism the first two hold N/t tokens and
  the third is the all-gathered full sequence;
- attention: rotated q and k, the kv projection output (v lives in it), the output and the
  log-sum-exp of each query row: N·(a/t)·d·2 + N·k·d·3 + N·a/t (the s×s score matrix is never
  stored: SDPA's flash kernels recompute it);
- SwiGLU: gate, up, silu(gate) and their product: 4·N·f/t.

``selective`` recompute drops the log-sum-exp (the attention core is recomputed; its inputs
and output stay alive anyway), ``full`` keeps only each block's input: N/t·h under SP, N·h
without. The test suite checks the formula against
:func:`meshtron.training.memory.measure_saved_bytes`.
"""

from __future__ import annotations

from meshtron.config import ModelConfig
from meshtron.models.arch import architecture_of


def formula_covers(cfg: ModelConfig) -> bool:
    """The formula counts dense blocks of RMSNorm, rotary grouped-query attention and SwiGLU
    without biases (nor Gemma's norms after attention and MLP); MoE layers keep
    routing-dependent amounts, so no formula covers them."""
    arch = architecture_of(cfg)
    return (arch.norm_vectors == 1 and arch.rotary and arch.gated_mlp and not arch.bias
            and not arch.post_norms and not cfg.is_moe and not cfg.latent_attention)


def activation_bytes_per_layer(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1,
                               sp: bool = False, recompute: str = "none",
                               element_size: int = 4, selective: str = "core") -> int:
    """Bytes one llama block keeps for backward per micro-batch on one tensor-parallel rank;
    ``selective`` says what ``selective`` recompute means (:mod:`meshtron.costmodel.recompute`:
    ``ops`` keeps the block's input, q, v, the attention output with its log-sum-exp, the
    MLP's gate and its output; ``layers`` is priced by the caller as a mix of full and none)."""
    n = micro_batch * seq_len
    h = cfg.hidden_size
    d = cfg.head_size
    heads = cfg.num_heads // tp
    kv_heads = cfg.num_kv_heads // min(tp, cfg.num_kv_heads)
    ffn = cfg.ffn_hidden_size // tp
    local = n // tp if sp else n  # tokens of the residual stream held on this rank
    if recompute == "full":
        return element_size * local * h
    if recompute == "selective" and selective == "ops":
        return element_size * (2 * local * h + 2 * n * heads * d + n * kv_heads * d
                               + n * heads + n * ffn)
    norm = local * h + local + n * h
    attention = 2 * n * heads * d + 3 * n * kv_heads * d + n * heads
    if recompute == "selective":
        attention -= n * heads
    mlp = 4 * n * ffn
    return element_size * (2 * norm + attention + mlp)
