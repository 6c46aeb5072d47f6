"""Greedy generation: meshtron's ``Generator`` against Hugging Face ``generate``, one process.

Run from the repository root::

    .venv/bin/python benchmarks/inference.py [--rounds N] [--new-tokens N] [--prompt-len N]

The ``tiny`` preset's shape (4 layers, 256 wide, 8 heads, 4 kv heads, vocabulary 8192), fp32,
CPU, one thread, the same weights in both (meshtron's initialisation, converted with
``hf_mapping.to_hf``; HF with ``attn_implementation="sdpa"`` and its dynamic KV cache). Each
round decodes ``--new-tokens`` tokens greedily after a random prompt of ``--prompt-len``
tokens, at batch 1 and batch 8 (eight prompts of that length), with meshtron and HF taking
turns which goes first. Printed per batch size: the median over rounds of the time to the first
token (the prefill and one sampled token) and of the decode tokens per second after it (all
sequences counted), for each; the ratio meshtron / HF of decode throughput; meshtron's batch-8
throughput over its batch-1 throughput; and whether the two produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtron.checkpoint.hf_mapping import hf_config_kwargs, to_hf
from meshtron.config import load_config
from meshtron.models.generation import Generator
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer


class FirstTokenTimer:
    """A ``transformers`` streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        """The streamer interface's end of generation: nothing is buffered here."""


def hf_round(hf, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, list]:
    timer = FirstTokenTimer()
    started = time.perf_counter()
    out = hf.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, streamer=timer if len(prompts) == 1 else None,
                      pad_token_id=0)
    total = time.perf_counter() - started
    if timer.first is None:  # batches: HF's streamer takes batch 1 only; time the prefill
        t0 = time.perf_counter()
        hf.generate(prompts, max_new_tokens=1, do_sample=False, pad_token_id=0)
        first = time.perf_counter() - t0
    else:
        first = timer.first - started
    decode = len(prompts) * (new_tokens - 1) / max(total - first, 1e-9)
    return first, decode, out[:, prompts.shape[1]:].tolist()


def ours_round(generator: Generator, prompts: torch.Tensor, new_tokens: int
               ) -> tuple[float, float, list]:
    completions, stats = generator.generate(prompts.tolist(), new_tokens)
    return stats.first_token_s, stats.decode_tokens_per_s, [c.tokens for c in completions]


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(overrides=["--model.preset=tiny", "--model.vocab_size=8192"]).model
    model = Transformer(cfg)
    initialize(model, seed=0, std=0.02, num_layers=cfg.num_layers)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_config_kwargs(cfg), attn_implementation="sdpa")).eval()
    hf.load_state_dict(to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg))
    hf.generation_config.eos_token_id = None
    generator = Generator(model)
    gen = torch.Generator().manual_seed(0)
    print(f"tiny ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M), prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new, {args.rounds} rounds, fp32, 1 thread")
    print("batch | ttft ms meshtron | ttft ms HF | decode tok/s meshtron | decode tok/s HF | "
          "meshtron/HF | same tokens")
    throughput = {}
    for batch in (1, 8):
        prompts = torch.randint(1, cfg.vocab_size, (batch, args.prompt_len), generator=gen)
        runs: dict[str, list[tuple[float, float, list]]] = {"ours": [], "hf": []}
        with torch.no_grad():
            for round_ in range(args.rounds + 1):  # round 0 warms up
                order = ("ours", "hf") if round_ % 2 == 0 else ("hf", "ours")
                for name in order:
                    result = (ours_round(generator, prompts, args.new_tokens) if name == "ours"
                              else hf_round(hf, prompts, args.new_tokens))
                    if round_:
                        runs[name].append(result)
        med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
               for name, rs in runs.items()}
        same = runs["ours"][0][2] == runs["hf"][0][2]
        throughput[batch] = med["ours"][1]
        print(f"{batch:5d} | {1e3 * med['ours'][0]:16.1f} | {1e3 * med['hf'][0]:10.1f} | "
              f"{med['ours'][1]:21.1f} | {med['hf'][1]:15.1f} | "
              f"{med['ours'][1] / med['hf'][1]:11.2f} | {same}")
    print(f"meshtron batch 8 / batch 1 decode throughput: {throughput[8] / throughput[1]:.2f}")


if __name__ == "__main__":
    main()
