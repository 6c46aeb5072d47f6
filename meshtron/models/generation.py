"""Autoregressive sampling with a KV cache: temperature, top-k and nucleus (top-p)."""

from __future__ import annotations

import torch

from meshtron.models.transformer import Transformer


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf (last dim is the vocabulary)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before > top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens; stop early at ``eos_id``."""
    model.eval()
    max_len = model.cfg.max_seq_len
    prompt = prompt[-(max_len - 1):] if prompt else [eos_id or 0]
    max_new_tokens = min(max_new_tokens, max_len - len(prompt))
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache(1, len(prompt) + max_new_tokens)
    tokens = torch.tensor([prompt], device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens, cache)[0, -1, : model.vocab_size].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = filter_logits(logits / temperature, top_k, top_p)
            next_id = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        if next_id == eos_id:
            break
        out.append(next_id)
        tokens = torch.tensor([[next_id]], device=device)
    return out
