"""What a low-precision block keeps from forward to backward: at most what bf16 keeps.

A bf16 linear layer keeps its input (2 bytes an element; layers reading the same input share
it). An FP8/FP4 layer keeps its input quantised for the weight-gradient product (1 byte, plus
scales) and, of its weight, which is alive anyway, only the scales: the weight's fp8/fp4 copy
is formed again in backward. Measured as every storage created in the forward pass and still
alive before backward (``LiveTensorBytes``), in a one-block model whose other parts (embedding,
output layer, loss) are alike in every recipe: autograd's saved-tensor hooks do not see what
the low-precision layers keep on their context objects.
"""

from __future__ import annotations

import torch

from meshtron.config import load_config
from meshtron.models.init import initialize
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.precision.recipes import LayerPolicy
from meshtron.training.live_memory import LiveTensorBytes

RECIPES = {
    "bf16": [],
    "tensorwise": ["--precision.fp8=tensorwise"],
    "blockwise": ["--precision.fp8=blockwise", "--precision.fp8_block=32"],
    "mxfp8": ["--precision.fp8=mxfp8"],
    "nvfp4": ["--precision.fp4=nvfp4"],
}


def kept_bytes(knobs: list[str]) -> int:
    """Bytes a one-block model keeps after the forward pass of 2 x 32 tokens (hidden 128,
    ffn 256)."""
    tokens = torch.randint(0, 500, (2, 33), generator=torch.Generator().manual_seed(0))
    cfg = load_config(overrides=[
        "--model.vocab_size=512", "--model.hidden_size=128", "--model.num_heads=4",
        "--model.ffn_hidden_size=256", "--model.num_layers=1", "--precision.dtype=bf16",
        *knobs])
    policy = LayerPolicy(cfg.precision, 1) if knobs else None
    model = Transformer(cfg.model, options=ModelOptions(fp8=policy))
    initialize(model, seed=0, std=0.02, num_layers=1)
    model.to(torch.bfloat16)
    with LiveTensorBytes() as live:
        loss = model.loss_sum(model(tokens[:, :-1]), tokens[:, 1:])
        return live.bytes() + 0 * loss.numel()


def test_low_precision_blocks_keep_no_more_than_bf16():
    kept = {name: kept_bytes(knobs) for name, knobs in RECIPES.items()}
    assert all(nbytes <= kept["bf16"] for nbytes in kept.values()), kept
