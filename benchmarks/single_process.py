"""Single-process figures: meshtron's training step against Hugging Face, and preprocessing.

Run from the repository root::

    .venv/bin/python benchmarks/single_process.py [--steps N] [--user-steps N] [--json OUT]

1. **Training step** (forward, backward and AdamW step; fp32; CPU) of meshtron's ``Transformer``
   and of ``transformers.LlamaForCausalLM`` with the same shape and the same weights (meshtron's
   initialisation, converted with ``hf_mapping.to_hf``). HF runs with
   ``attn_implementation="sdpa"`` and ``use_cache=False`` (no KV cache is built in training).
   Both losses are the mean token cross-entropy over the same ``batch * seq`` targets:
   meshtron's ``loss_sum(logits, targets) / tokens``; HF's own loss, ``model(input_ids,
   labels=targets, shift_labels=targets).loss`` (its ``ForCausalLMLoss``: fp32
   ``F.cross_entropy``, mean; ``shift_labels`` passes the targets already shifted, where
   ``labels`` alone would shift inside and drop one target per row). Both use
   ``torch.optim.AdamW(foreach=True)`` with the same parameter groups and hyper-parameters
   (meshtron's ``build_adamw`` and training defaults), and the same thread count (one process).
   The two models' steps are interleaved in rounds (``harness.interleave``): in every round
   each model takes one step, and which of the two goes first alternates every round
   (meshtron first in round 0, HF first in round 1, ..., warm-up rounds included), so load
   from other processes hits both alike and neither always runs first. Figures are medians
   over ``--steps`` steps each; ratio = meshtron median / HF median; "pair ratio" = the median
   over rounds of meshtron's step time / HF's step time in the same round (less sensitive to
   slow drifts in load). The first steps' losses are checked to agree, which shows that the
   weights and the loss are the same. ``--compiled`` adds ``meshtron+compile`` (the same model
   built with ``ModelOptions(compile=True)``: each block one Inductor graph) and
   ``hf+compile`` (``torch.compile`` of the whole HF model), each with its own copy of the
   weights and optimizer, in the same rounds; the compile happens in the warm-up rounds, and the
   compiled pair is compared best against best. ``--profile`` adds one profiled step of each
   model after the timed ones (``step_profile``): operator self time per kind of work, the
   GFLOP/s of every product shape of meshtron's step against a 2048-square product in the same
   process, and the time a step at 0.9x HF's would leave for everything but the products and
   attention (which both run in the same kernels).
2. **The user's path** (``trainer_path.py``): ``meshtron train``'s whole step (tiny preset, seq
   128, global batch 8, one micro-batch; data fetch, ``train_step``, metrics row) against a plain
   HF loop of the same shape (same weights and batches, ``clip_grad_norm_(1.0)``, torch AdamW
   foreach), and meshtron's model in that same loop; ``--user-steps`` interleaved rounds (order
   rotating), medians, ratio and pair ratio to the HF loop (and process CPU time).
3. **Preprocessing**: MB/s (1e6 bytes of UTF-8 text per second) of ``meshtron.data.preprocess``
   on the embedded default corpus (``stdlib_corpus`` at the default ``data.corpus_max_mb``) with
   a byte-level BPE of the default ``data.vocab_size`` trained once in a temporary cache
   (training timed separately); median of ``--preprocess-runs`` runs, each into a fresh
   temporary directory.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import step_profile
import torch
import trainer_path
import transformers
from torch import nn

# meshtron: used in build_steps and bench_preprocess only
from meshtron.checkpoint.hf_mapping import hf_config_kwargs, to_hf
from meshtron.config import load_config
from meshtron.data import stdlib_corpus
from meshtron.data.preprocessing import preprocess
from meshtron.data.tokenizer import train_tokenizer
from meshtron.models.init import initialize
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.optim.adamw import build_adamw


@dataclass(frozen=True)
class Shape:
    overrides: tuple[str, ...]
    seq: int
    batch: int


SHAPES = {
    "tiny": Shape(("--model.preset=tiny", "--model.vocab_size=4096"), seq=128, batch=16),
    "llama-30m": Shape(
        ("--model.preset=tiny", "--model.num_layers=8", "--model.hidden_size=512",
         "--model.num_heads=8", "--model.num_kv_heads=4", "--model.ffn_hidden_size=1536",
         "--model.vocab_size=8192"),
        seq=256, batch=4,
    ),
}


def build_steps(shape: Shape, compiled: bool = False
                ) -> tuple[int, dict[str, Callable[[], float]]]:
    """meshtron's parameter count and one training step of each model (``meshtron``, ``hf``,
    with ``compiled`` also ``meshtron+compile`` and ``hf+compile``), on the same batch and
    weights; a step returns its loss."""
    cfg = load_config(overrides=shape.overrides)
    model = Transformer(cfg.model)  # the model alone, in the same plain loop as HF
    initialize(model, seed=cfg.train.seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    weights = {k: v.detach() for k, v in model.state_dict().items()}

    def hf_model() -> nn.Module:
        net = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**hf_config_kwargs(cfg.model), attn_implementation="sdpa"))
        assert net.config._attn_implementation == "sdpa"
        net.load_state_dict(to_hf(weights, cfg.model))
        return net

    hf = hf_model()
    tokens = torch.randint(0, cfg.model.vocab_size, (shape.batch, shape.seq + 1),
                           generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].contiguous()
    count = targets.numel()

    def hf_loss(net: nn.Module) -> torch.Tensor:
        return net(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False).loss

    def trainer(net: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> Callable[[], float]:
        net.train()
        optimizer = build_adamw(net, cfg.train)

        def step() -> float:
            optimizer.zero_grad(set_to_none=True)
            value = loss(net)
            value.backward()
            optimizer.step()
            return value.item()

        return step

    def ours(net: nn.Module) -> torch.Tensor:
        return net.loss_sum(net(inputs), targets) / count

    params = sum(p.numel() for p in model.parameters())
    steps = {"meshtron": trainer(model, ours), "hf": trainer(hf, hf_loss)}
    if compiled:
        twin = Transformer(cfg.model, options=ModelOptions(compile=True))
        twin.load_state_dict(weights)
        steps["meshtron+compile"] = trainer(twin, ours)
        steps["hf+compile"] = trainer(torch.compile(hf_model()), hf_loss)
    return params, steps


def where_time_goes(calls: dict[str, Callable[[], float]], meshtron_s: float,
                    hf_s: float) -> dict[str, Any]:
    """One profiled step of meshtron and of HF: seconds per kind of work (operator self time,
    ``step_profile``), every product's GFLOP/s, and the one-thread product ceiling. Then, from
    the timed medians (the profiler slows the model with more operators more): what a step at
    0.9x HF's leaves for everything but the products and attention, which both models run in
    the same kernels, against what meshtron's step spends beyond them."""
    out: dict[str, Any] = {"peak_gemm_gflops": round(step_profile.peak_gemm_gflops(), 1)}
    for model in ("meshtron", "hf"):
        out[model] = {**step_profile.profile_step(calls[model], torch.device("cpu"),
                                                  lambda: None),
                      "gemms": step_profile.gemm_rates(calls[model])}
    ours = out["meshtron"]["seconds"]
    shared = ours.get("gemm", 0.0) + ours.get("attention", 0.0)
    out["budget_rest_s"] = 0.9 * hf_s - shared
    out["meshtron_rest_s"] = meshtron_s - shared
    return out


def bench_step(name: str, shape: Shape, steps: int, warmup: int,
               compiled: bool = False, profiled: bool = False) -> dict[str, Any]:
    params, calls = build_steps(shape, compiled)
    run = harness.interleave(calls, steps, warmup=warmup)  # who goes first alternates
    harness.check_close(run.first, f"{name}: first losses", reference="hf")
    times = run.wall
    tokens = shape.batch * shape.seq
    ours_s, theirs_s = statistics.median(times["meshtron"]), statistics.median(times["hf"])
    return {
        "shape": name, "params": params, "batch": shape.batch, "seq": shape.seq,
        "overrides": list(shape.overrides), "first_loss": run.first,
        "meshtron_s": ours_s, "hf_s": theirs_s,
        "ratio": harness.ratio_of_medians(times["meshtron"], times["hf"]),
        "pair_ratio_median": harness.pair_ratio(times["meshtron"], times["hf"]),
        "meshtron_tokens_per_s": tokens / ours_s, "hf_tokens_per_s": tokens / theirs_s,
        "steps": times,
        **({"compiled": {
            "meshtron_s": statistics.median(times["meshtron+compile"]),
            "hf_s": statistics.median(times["hf+compile"]),
            "ratio": harness.ratio_of_medians(times["meshtron+compile"], times["hf+compile"]),
            "pair_ratio_median": harness.pair_ratio(times["meshtron+compile"],
                                                    times["hf+compile"]),
            "vs_hf_eager_pair_ratio": harness.pair_ratio(times["meshtron+compile"], times["hf"]),
        }} if compiled else {}),
        **({"profile": where_time_goes(calls, ours_s, theirs_s)} if profiled else {}),
    }


def print_profile(row: dict[str, Any]) -> None:
    prof = row["profile"]
    print(f"\n{row['shape']}: one profiled step each (operator self time, s); one-thread "
          f"product ceiling {prof['peak_gemm_gflops']} GFLOP/s\n")
    kinds = sorted(set(prof["meshtron"]["seconds"]) | set(prof["hf"]["seconds"]))
    print(harness.markdown_table(
        ("model", "total", *kinds),
        ((model, f"{prof[model]['total_s']:.3f}",
          *(f"{prof[model]['seconds'].get(k, 0.0):.3f}" for k in kinds))
         for model in ("meshtron", "hf"))))
    print("\nmeshtron's products (slowest first)\n")
    print(harness.markdown_table(
        ("product", "calls", "s", "GFLOP/s"),
        ((g["shape"], g["calls"], f"{g['s']:.3f}", g["gflops"])
         for g in prof["meshtron"]["gemms"])))
    print(f"\nat 0.9x HF's median step, {1e3 * prof['budget_rest_s']:.0f} ms would be left for "
          f"everything but products and attention (profiled); meshtron's median step spends "
          f"{1e3 * prof['meshtron_rest_s']:.0f} ms there")


def bench_preprocess(runs: int) -> dict[str, Any]:
    data = load_config().data
    source = stdlib_corpus(int(data.corpus_max_mb * 1e6))
    quiet: Callable[[str], None] = lambda _: None  # noqa: E731
    with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        tokenizer = train_tokenizer(source, data.vocab_size, cache_dir, quiet)
        train_s = time.perf_counter() - start
        results = []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as out:
                results.append(preprocess([source], Path(out) / "data", tokenizer, quiet))
    rates = [r["mb_per_s"] for r in results]
    return {
        "corpus": source.name, "input_bytes": source.num_bytes, "vocab_size": data.vocab_size,
        "tokenizer_train_s": train_s, "tokens": results[0]["tokens"],
        "documents": results[0]["documents"], "mb_per_s": statistics.median(rates),
        "runs_mb_per_s": rates,
    }


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.steps(10, "timed steps per model and shape"), cli.warmup(2))
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--preprocess-runs", type=int, default=3, help="0 skips preprocessing")
    parser.add_argument("--user-steps", type=int, default=20,
                        help="timed rounds of the user's path (meshtron train's step); 0 skips")
    parser.add_argument("--data-cache", help="data.cache_dir of the user's path (default: the "
                        "config's)")
    parser.add_argument("--no-model-step", action="store_true",
                        help="skip the model-only training step comparison")
    parser.add_argument("--compiled", action="store_true",
                        help="also time both models under torch.compile")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step of each model: time per kind of work, "
                        "each product's GFLOP/s against a large product's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = harness.host_info(transformers=transformers.__version__,
                     torch_threads=torch.get_num_threads())
    print(harness.host_line(info, f"{info['torch_threads']} torch threads, transformers "
                          f"{info['transformers']}"))
    rows = []
    for name in [] if args.no_model_step else args.shapes:
        if not rows:
            print(f"\ntraining step (fp32, AdamW), median of {args.steps} interleaved steps each; "
                  "ratio = meshtron / HF; pair ratio = median over steps of meshtron / the HF "
                  "step of the same round")
        rows.append(bench_step(name, SHAPES[name], args.steps, args.warmup, args.compiled,
                               args.profile))
        print(f"  {name}: meshtron {rows[-1]['meshtron_s']:.3f}, HF {rows[-1]['hf_s']:.3f} "
              "s/step", flush=True)
    if rows:
        print()
        print(harness.markdown_table(
            ("shape", "params", "tokens / step", "meshtron s/step", "HF s/step", "ratio",
             "pair ratio", "meshtron tokens/s", "HF tokens/s"),
            ((r["shape"], f"{r['params'] / 1e6:.1f}M", r["batch"] * r["seq"],
              f"{r['meshtron_s']:.3f}", f"{r['hf_s']:.3f}", f"{r['ratio']:.3f}",
              f"{r['pair_ratio_median']:.3f}", f"{r['meshtron_tokens_per_s']:.0f}",
              f"{r['hf_tokens_per_s']:.0f}") for r in rows)))
        if args.compiled:
            print("\ncompiled (meshtron: train.compile's blocks; HF: torch.compile of the "
                  "model), same rounds\n")
            print(harness.markdown_table(
                ("shape", "meshtron+compile s/step", "HF+compile s/step", "ratio", "pair ratio",
                 "pair ratio vs HF eager"),
                ((r["shape"], f"{c['meshtron_s']:.3f}", f"{c['hf_s']:.3f}", f"{c['ratio']:.3f}",
                  f"{c['pair_ratio_median']:.3f}", f"{c['vs_hf_eager_pair_ratio']:.3f}")
                 for r in rows for c in [r["compiled"]])))
    for row in rows if args.profile else []:
        print_profile(row)
    result = harness.record(info, train_step=rows)
    if args.user_steps > 0:
        user = trainer_path.bench_user_path(args.user_steps, args.warmup, args.data_cache)
        result["user_path"] = user
        parts = ", ".join(f"{k} {v:.2f} ms" for k, v in user["parts_ms"].items())
        print(f"\nthe user's path: {user['command']} ({user['params'] / 1e6:.1f}M params, vocab "
              f"{user['vocab']}, {user['tokens']} tokens / step), median of {args.user_steps} "
              f"interleaved steps each; ratios to the HF loop; trainer parts: {parts}; trainer "
              f"/ meshtron model pair ratio {user['trainer_over_model_pair_ratio']:.3f}\n")
        print(trainer_path.user_path_table(user))
    if args.preprocess_runs > 0:
        pre = bench_preprocess(args.preprocess_runs)
        result["preprocess"] = pre
        print(f"\npreprocessing {pre['corpus']} with a {pre['vocab_size']}-token BPE: "
              f"{pre['mb_per_s']:.2f} MB/s (median of {args.preprocess_runs}: "
              f"{', '.join(f'{r:.2f}' for r in pre['runs_mb_per_s'])}), "
              f"{pre['tokens'] / 1e6:.2f}M tokens; tokenizer training "
              f"{pre['tokenizer_train_s']:.1f} s")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
