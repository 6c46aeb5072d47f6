"""Step time and memory of fine-tuning peers measured side by side, interleaved (issue 48,
item 4): meshtron full fine-tuning, meshtron LoRA and transformers + peft LoRA on the same
model, batch and thread count.

Each peer is a worker process of its own (so its peak memory is its own) that loads once and
then takes one optimizer step whenever the driver asks. The driver loads the workers one after
the other, then asks each for a step in turn, round after round (the order rotating), so a
change in the machine's load falls on every peer alike; each peer's figure is the median of its
steps after the warm-up rounds. The meshtron workers run the trainer's own step
(:func:`meshtron.training.step.train_step` on the trainer's batches, the same code path as
``meshtron train``); the peft worker takes the same batches (prompt tokens read, never
predicted) through ``get_peft_model`` with the same rank, alpha and projections and AdamW on
the adapters, the loss being the mean cross-entropy of the answer tokens as meshtron's.

Used by ``benchmarks/chat_finetune.py``; on its own (a run directory per worker under OUT)::

    python benchmarks/finetune_timing.py worker '{"kind": "peft", ...}'
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""HF names of what meshtron's default LoRA targets adapt (attention and MLP)."""
TAG = "@@"
"""Prefix of the lines a worker tells the driver (anything else it prints is not read)."""

Step = Callable[[int], float]
"""One timed optimizer step on batch ``k``: its seconds."""


def meshtron_worker(spec: dict) -> tuple[Step, int]:
    """A meshtron trainer from ``spec``'s config and overrides; a step is the trainer's
    ``train_step`` on its batch ``k``, timed. With the count of trained parameters."""
    from meshtron.config import load_config
    from meshtron.training.step import train_step
    from meshtron.training.trainer import Trainer

    trainer = Trainer(load_config(spec["config"], spec["overrides"]),
                      log=lambda line: print(line, file=sys.stderr))
    t = trainer.cfg.train

    def step(k: int) -> float:
        batch = trainer.local_share(trainer.data.train_batch(k, t.global_batch))
        start = time.perf_counter()
        train_step(trainer.rank, batch, t.lr)
        return time.perf_counter() - start
    return step, sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)


def hf_batches(spec: dict) -> Callable[[int], tuple]:
    """meshtron's training batches as (input ids, targets with -100 where no loss)."""
    import torch

    from meshtron.config import load_config
    from meshtron.data.builders import build_run_data

    cfg = load_config(spec["config"], spec["overrides"])
    data = build_run_data(cfg, lambda line: None)

    def batch(k: int) -> tuple:
        rows = data.train_batch(k, cfg.train.global_batch)
        ids = torch.where(rows < 0, -rows - 1, rows)
        targets = torch.where(rows[:, 1:] < 0, torch.full_like(ids[:, 1:], -100), ids[:, 1:])
        return ids[:, :-1].contiguous(), targets.contiguous()
    return batch


def peft_worker(spec: dict) -> tuple[Step, int]:
    """transformers + peft on the exported HF folder; a step is forward, the answers' mean
    cross-entropy, backward and AdamW on the adapters, timed. With the count of trained
    parameters."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"],
                                             lora_dropout=0.0, target_modules=PROJECTIONS,
                                             bias="none"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.0)
    batches = hf_batches(spec)

    def step(k: int) -> float:
        ids, targets = batches(k)
        start = time.perf_counter()
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start
    return step, sum(p.numel() for p in params)


def serve(spec: dict) -> None:
    """The worker's loop: load, say ready, then a timed step per ``step K`` line until
    ``done`` (answered with the process's peak RSS, what meshtron's mem_peak_bytes is on
    CPU)."""
    import torch

    torch.set_num_threads(spec["threads"])
    step, trained = (peft_worker if spec["kind"] == "peft" else meshtron_worker)(spec)
    print(TAG, json.dumps({"trained": trained}), flush=True)
    for line in sys.stdin:
        if line.startswith("step"):
            print(TAG, json.dumps({"s": step(int(line.split()[1]))}), flush=True)
        else:
            break
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(TAG, json.dumps({"peak_bytes": peak, "threads": torch.get_num_threads(),
                           "trained": trained}), flush=True)


def _told(proc: subprocess.Popen) -> dict:
    """The worker's next message (a worker that ended instead stops the benchmark)."""
    for line in proc.stdout:
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    sys.exit(f"a timing worker ended (exit {proc.wait()}) before answering")


def interleaved(specs: dict[str, dict], rounds: int, warmup: int) -> dict[str, dict]:
    """Each named worker's median step time over ``rounds`` after ``warmup`` rounds, its
    steps and peak memory; the workers loaded one at a time, then stepped in turn."""
    procs = {}
    for name, spec in specs.items():
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "worker", json.dumps(spec)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"])})
        _told(procs[name])
    times: dict[str, list[float]] = {name: [] for name in specs}
    names = list(specs)
    for r in range(warmup + rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            procs[name].stdin.write(f"step {r}\n")
            procs[name].stdin.flush()
            times[name].append(_told(procs[name])["s"])
    result = {}
    for name, proc in procs.items():
        proc.stdin.write("done\n")
        proc.stdin.flush()
        end = _told(proc)
        proc.wait()
        result[name] = {"step_s": statistics.median(times[name][warmup:]),
                        "steps_s": [round(t, 3) for t in times[name]], **end}
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        serve(json.loads(sys.argv[2]))
    else:
        sys.exit(f"usage: {Path(__file__).name} worker SPEC (started by chat_finetune.py)")
