"""The user's path, for ``single_process.py``: ``meshtron train``'s whole step against a plain
transformers training loop of the same shape (imported by that script, not run alone).

The trainer is built as ``meshtron train --model.preset=tiny --train.seq_len=128
--train.global_batch=8 --train.micro_batch=8`` builds it (default data: the embedded corpus,
its 8192-token BPE; progress bar, plots, resume and checkpoints off, none of which is in a
step). Its timed call is the part of ``Trainer.run``'s loop that ``step_time_s`` covers (the
learning rate, the data fetch with ``local_share``, ``train_step``) plus the metrics row built
after it. The HF loop fetches the same batch from the same data, and runs
``LlamaForCausalLM`` (sdpa, same weights via ``hf_mapping.to_hf``, its own mean loss),
``clip_grad_norm_(1.0)`` and ``torch.optim.AdamW(foreach=True)`` with meshtron's parameter
groups, hyper-parameters and learning-rate schedule. A third competitor, meshtron's model in
that same plain loop, tells what the trainer's path adds from what the model does. CPU
figures are process time (every thread of the process).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import harness
import torch
import transformers
from torch import nn

from meshtron.checkpoint.hf_mapping import hf_config_kwargs, to_hf
from meshtron.config import TrainConfig, load_config
from meshtron.models.transformer import Transformer
from meshtron.optim.lr_schedule import learning_rate
from meshtron.training.step import train_step
from meshtron.training.trainer import Trainer

USER_COMMAND = ("--model.preset=tiny", "--train.seq_len=128", "--train.global_batch=8",
                "--train.micro_batch=8")
QUIET = ("--run.progress=false", "--run.plot=false", "--checkpoint.resume=false")


def torch_adamw(model: nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """What a plain loop would build: torch's foreach AdamW, decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             foreach=True)


def trainer_call(trainer: Trainer, parts: dict[str, list[float]]) -> Callable[[], float]:
    """One step of ``Trainer.run``'s loop, as far as its metrics row; appends the seconds of
    each part (fetch, train_step, row) to ``parts``; returns the loss."""
    t = trainer.cfg.train

    def step() -> float:
        started = time.perf_counter()
        lr = learning_rate(trainer.step, t)
        batch = trainer.local_share(trainer.data.train_batch(trainer.step, t.global_batch))
        fetched = time.perf_counter()
        out = train_step(trainer.rank, batch, lr)
        stepped = time.perf_counter()
        trainer.step += 1
        trainer._row(out, lr, stepped - started)
        parts["fetch"].append(fetched - started)
        parts["train_step"].append(stepped - fetched)
        parts["row"].append(time.perf_counter() - stepped)
        return out.loss

    return step


def plain_call(trainer: Trainer, model: nn.Module,
               loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Callable[[], float]:
    """The plain loop over the trainer's batches: zero_grad, mean loss, backward,
    ``clip_grad_norm_``, AdamW at the trainer's learning rate; returns the loss."""
    t = trainer.cfg.train
    model.train()
    optimizer = torch_adamw(model, t)
    step_index = [0]

    def step() -> float:
        k = step_index[0]
        step_index[0] += 1
        batch = trainer.data.train_batch(k, t.global_batch)
        optimizer.zero_grad(set_to_none=True)
        value = loss(model, batch)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(k, t)
        optimizer.step()
        return value.item()

    return step


def hf_loss(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """HF's own mean loss; ``shift_labels``: the targets are already shifted."""
    inputs, targets = batch[:, :-1], batch[:, 1:].contiguous()
    return net(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False).loss


def meshtron_loss(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    targets = batch[:, 1:]
    return net.loss_sum(net(batch[:, :-1]), targets) / targets.numel()


def bench_user_path(steps: int, warmup: int, data_cache: str | None) -> dict[str, Any]:
    """Trainer step, the HF loop and meshtron's model in the same loop, interleaved (the order
    rotating every round); medians, ratios to HF and pair ratios."""
    extra = (f"--data.cache_dir={data_cache}",) if data_cache else ()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(overrides=[*USER_COMMAND, *QUIET, *extra, f"--run.dir={run_dir}"])
        trainer = Trainer(cfg, log=lambda _: None)
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        model_cfg = trainer.cfg.model
        hf = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**hf_config_kwargs(model_cfg), attn_implementation="sdpa"))
        hf.load_state_dict(to_hf(state, model_cfg))
        twin = Transformer(model_cfg)  # the model alone, for the plain loop: no rank
        twin.load_state_dict(state)
        parts: dict[str, list[float]] = {"fetch": [], "train_step": [], "row": []}
        calls = {"trainer": trainer_call(trainer, parts),
                 "meshtron_model": plain_call(trainer, twin, meshtron_loss),
                 "hf": plain_call(trainer, hf, hf_loss)}
        run = harness.interleave(calls, steps, warmup=warmup, cpu=time.process_time)
    harness.check_close(run.first, "user path: first losses", reference="hf")
    wall, cpu, tokens = run.wall, run.cpu, cfg.train.global_batch * cfg.train.seq_len
    out: dict[str, Any] = {
        "command": "meshtron train " + " ".join(USER_COMMAND), "tokens": tokens,
        "params": sum(p.numel() for p in twin.parameters()), "vocab": model_cfg.vocab_size,
        "first_loss": run.first, "steps": wall, "steps_cpu": cpu,
        "parts_ms": {k: 1e3 * statistics.median(v[warmup:]) for k, v in parts.items()},
    }
    for name in calls:
        out[f"{name}_s"] = statistics.median(wall[name])
        out[f"{name}_ratio"] = harness.ratio_of_medians(wall[name], wall["hf"])
        out[f"{name}_pair_ratio"] = harness.pair_ratio(wall[name], wall["hf"])
        out[f"{name}_cpu_s"] = statistics.median(cpu[name])
        out[f"{name}_cpu_ratio"] = harness.ratio_of_medians(cpu[name], cpu["hf"])
    out["trainer_over_model_pair_ratio"] = harness.pair_ratio(wall["trainer"],
                                                              wall["meshtron_model"])
    return out


def user_path_table(r: dict[str, Any]) -> str:
    """The table docs/performance.md shows (ratios are to the HF loop; CPU: process time)."""
    names = {"trainer": "`meshtron train` step (fetch, train_step, metrics row)",
             "meshtron_model": "meshtron's model in the plain loop",
             "hf": "HF `LlamaForCausalLM` in the plain loop"}
    return harness.markdown_table(
        ("step", "s/step", "ratio", "pair ratio", "CPU s/step", "CPU ratio"),
        ((text, f"{r[f'{k}_s']:.3f}", f"{r[f'{k}_ratio']:.3f}", f"{r[f'{k}_pair_ratio']:.3f}",
          f"{r[f'{k}_cpu_s']:.3f}", f"{r[f'{k}_cpu_ratio']:.3f}") for k, text in names.items()))
