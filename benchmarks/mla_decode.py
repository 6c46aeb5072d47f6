"""Latent attention's decode step: weight-absorbed against expanding the cache.

Run from the repository root::

    .venv/bin/python benchmarks/mla_decode.py [--steps N] [--lengths 512,2048,8192]

One ``LatentAttention`` layer with DeepSeek-V3's per-head widths (kv_lora_rank 512, q_lora_rank
1536 scaled to the width, nope 128, rope 64, v 128) and 16 heads of a 2048-wide model, fp32,
batch 1, one thread. For each cached length L the layer decodes one token over a cache of L
latents both ways, alternating which goes first every round (so load from other processes hits
both alike): ``absorbed`` folds ``kv_b`` into the query and the output (O(L · heads · kv_rank)
per step); ``expanded`` multiplies all L cached latents by ``kv_b`` into every head's keys and
values first (O(L · kv_rank · heads · (nope + v))). Prints the median step time of each over
``--steps`` rounds, their ratio (expanded / absorbed), and the largest difference between the
two outputs (they compute the same attention).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtron.config import load_config
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer

WIDTHS = ["--model.hidden_size=2048", "--model.num_heads=16", "--model.num_kv_heads=16",
          "--model.num_layers=1",
          "--model.attention=mla", "--model.q_lora_rank=384", "--model.kv_lora_rank=512",
          "--model.qk_nope_head_dim=128", "--model.qk_rope_head_dim=64",
          "--model.v_head_dim=128", "--model.ffn_hidden_size=64", "--model.vocab_size=256",
          "--model.max_seq_len=16384"]


def decode_times(model: Transformer, length: int, steps: int) -> dict[str, float]:
    attn = model.blocks()[0].attn
    cache = model.new_cache(1, length + 1)
    x = torch.randn(1, length, model.cfg.hidden_size)
    with torch.no_grad():
        model.blocks()[0](x, model.rotary, cache)  # fill the cache with L latents
        step = torch.randn(1, 1, model.cfg.hidden_size)
        times: dict[bool, list[float]] = {True: [], False: []}
        outputs = {}
        for round_ in range(steps + 2):  # two warm-up rounds
            for absorb in ((True, False) if round_ % 2 == 0 else (False, True)):
                attn.absorb = absorb
                cache.length = length
                started = time.perf_counter()
                outputs[absorb] = attn(step, model.rotary, cache)
                if round_ >= 2:
                    times[absorb].append(time.perf_counter() - started)
    absorbed, expanded = statistics.median(times[True]), statistics.median(times[False])
    return {"length": length, "absorbed_ms": 1e3 * absorbed, "expanded_ms": 1e3 * expanded,
            "ratio": expanded / absorbed,
            "max_diff": float((outputs[True] - outputs[False]).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lengths", default="512,2048,8192")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(overrides=WIDTHS).model
    model = Transformer(cfg).eval()
    initialize(model, seed=0, std=0.02, num_layers=1)
    print("cached L | absorbed ms | expanded ms | expanded/absorbed | max |diff|")
    for length in (int(n) for n in args.lengths.split(",")):
        r = decode_times(model, length, args.steps)
        print(f"{r['length']:8d} | {r['absorbed_ms']:11.2f} | {r['expanded_ms']:11.2f} | "
              f"{r['ratio']:17.2f} | {r['max_diff']:.1e}")


if __name__ == "__main__":
    main()
