"""One point of ``scaling.py``: a model shape and a step shape, measured through meshtron's own
training step and set beside the formulas that plan it (imported by that script, not run alone).

A point runs :func:`meshtron.training.step.train_step` on one process (fp32, AdamW, no data
parallelism), as the trainer does: ``micro_batches`` micro-batches of ``micro_batch`` sequences
of ``seq`` tokens, gradients accumulated, one optimizer step. It measures

- **time** (:func:`measure_time`, in a process on glibc's default heap, as training runs): the
  median wall time of ``steps`` steps after ``warmup``, and one more step under
  ``torch.profiler`` whose self CPU time, sorted into the classes of :data:`OP_CLASSES`, splits
  the median by the work each class does;
- **memory** (:func:`measure_memory`, in another process started on the exact heap, so freed
  memory leaves the resident set; its steps are slower, fresh pages for every large tensor, so
  they are not timed): the resident set's peak during a step after one warm-up step, above its
  level before the point was built (``peak_bytes``) and above its level between steps
  (``step_bytes``), and, without recompute, the bytes autograd saves for one micro-batch
  (``saved_bytes``, exact).

Each measured quantity has a formula from the code that plans runs, not from this file: FLOPs
from :mod:`meshtron.models.flops`, activations from
:func:`meshtron.costmodel.activations.activation_bytes_per_layer` and the state and transients of
:mod:`meshtron.costmodel.memory_model`. Work that no FLOP count describes is given the unit it
should scale with: the optimizer its parameters, the loss its logits, element-wise work the
activation elements of the blocks. The saved bytes add to the blocks' formula what the head
keeps: its norm (as a block's) and the fp32 logits the loss saves; they leave out the int64
token ids the embedding and the loss keep (at most two a token and one a row).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import harness
import torch

from meshtron.config import load_config
from meshtron.costmodel.activations import activation_bytes_per_layer
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.memory_model import stage_params, state_bytes, transient_bytes
from meshtron.models.arch import architecture_of
from meshtron.models.flops import model_size, padded_vocab_size, training_flops_per_token
from meshtron.models.transformer import Transformer
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.plan import plan_run
from meshtron.rank import build_rank
from meshtron.training.memory import measure_saved_bytes
from meshtron.training.step import train_step

OP_CLASSES = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv"),
    "attention": ("scaled_dot_product",),
    "loss": ("log_softmax", "CrossEntropy", "nll_loss", "aten::exp_"),
    "optimizer": ("adamw", "_foreach_", "Optimizer.step", "linalg_vector_norm"),
}
"""Profiler op names (substrings) of each time class; every other op is ``elementwise`` (norms,
activations, rotary, residual adds, copies). ``aten::exp_`` is the in-place exp of meshtron's
cross-entropy backward; ``linalg_vector_norm`` the gradient clipping's per-tensor norms."""

TIME_CLASSES = (*OP_CLASSES, "elementwise")


@dataclass(frozen=True)
class Shape:
    """A model (``model.FIELD=V`` overrides) and the step it takes."""

    name: str
    model: tuple[str, ...]
    seq: int
    micro_batch: int
    micro_batches: int = 1
    recompute: str = "none"

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch * self.micro_batches


def llama(layers: int, hidden: int, vocab: int = 8192) -> tuple[str, ...]:
    """A llama of ``layers`` blocks of width ``hidden``: heads of 64, half as many kv heads,
    SwiGLU of 3 x hidden, an untied head over ``vocab`` tokens."""
    heads = hidden // 64
    return ("--model.preset=tiny", f"--model.num_layers={layers}",
            f"--model.hidden_size={hidden}", f"--model.num_heads={heads}",
            f"--model.num_kv_heads={max(1, heads // 2)}", f"--model.ffn_hidden_size={3 * hidden}",
            f"--model.vocab_size={vocab}", "--model.max_seq_len=4096")


def op_class(name: str) -> str:
    """The time class of a profiler op (:data:`OP_CLASSES`)."""
    low = name.lower()
    for cls, parts in OP_CLASSES.items():
        if any(part.lower() in low for part in parts):
            return cls
    return "elementwise"


def class_seconds(events: Any) -> dict[str, float]:
    """Self CPU seconds of one profiled step by time class."""
    out = dict.fromkeys(TIME_CLASSES, 0.0)
    for e in events:
        out[op_class(e.key)] += e.self_cpu_time_total / 1e6
    return out


def formulas(shape: Shape) -> dict[str, float]:
    """What the planning code says each measured quantity is, or is proportional to."""
    cfg = load_config(overrides=shape.model).model
    size = model_size(cfg)
    layers, seq, tokens = cfg.num_layers, shape.seq, shape.tokens
    full = shape.recompute == "full"
    refold = 8 / 6 if full else 1.0  # full recompute runs each block's forward twice
    attention_flops = 6.0 * layers * seq * architecture_of(cfg).attention.score_width(cfg)
    per_layer = activation_bytes_per_layer(cfg, shape.micro_batch, seq, recompute=shape.recompute)
    whole_layer = activation_bytes_per_layer(cfg, shape.micro_batch, seq)
    n, h = shape.micro_batch * seq, cfg.hidden_size
    head_saved = 4 * (2 * n * h + n + n * padded_vocab_size(cfg))  # final norm, logits
    c = Candidate(tp=1, cp=1, pp=1, vpp=1, schedule="1f1b", ep=1, etp=None, dp=1, zero=0,
                  sp=False, micro_batch=shape.micro_batch, recompute=shape.recompute)
    stage = stage_params(cfg, list(range(layers)), embedding=True, head=True, pp=1)
    state = sum(state_bytes(stage, c, 4, 4).values())
    # the memory model's step buffers: one micro-batch's blocks in flight (and, under full
    # recompute, the layer being recomputed), the loss's fp32 logits and their gradient
    activations = layers * per_layer + (whole_layer if full else 0)
    buffers = activations + transient_bytes(cfg, stage, c, seq, True, 4, 4)
    return {
        "params": size.params,
        "model_flops": training_flops_per_token(cfg, seq) * tokens,
        "gemm": 6.0 * size.matmul_params * tokens * refold,
        "attention": attention_flops * tokens * refold,
        "loss": float(tokens * padded_vocab_size(cfg)),
        "optimizer": float(size.params),
        "elementwise": layers * whole_layer / 4 * shape.micro_batches * refold,
        "saved_bytes": float(layers * per_layer + head_saved),
        "step_bytes": float(buffers),
        "peak_bytes": float(state + buffers),
    }


def build_step(shape: Shape) -> tuple[Transformer, torch.Tensor, Callable[[], float]]:
    """The model, the step's batch and one training step (returning its loss)."""
    rows = shape.micro_batch * shape.micro_batches
    cfg = load_config(overrides=(*shape.model, f"--train.seq_len={shape.seq}",
                                 f"--train.global_batch={rows}",
                                 f"--train.micro_batch={shape.micro_batch}",
                                 f"--train.recompute={shape.recompute}", "--train.seed=0",
                                 "--train.grad_clip=1.0"))
    rank = build_rank(plan_run(cfg, 1), ParallelMesh.single())
    batch = torch.randint(0, cfg.model.vocab_size, (rows, shape.seq + 1),
                          generator=torch.Generator().manual_seed(0))

    def step() -> float:
        return train_step(rank, batch, 1e-4).loss

    return rank.model, batch, step


def measure_time(shape: Shape, steps: int, warmup: int) -> dict[str, Any]:
    """Wall seconds of ``steps`` steps after ``warmup``, and the median split by time class
    (one more step, profiled)."""
    _, _, step = build_step(shape)
    for _ in range(warmup):
        step()
    wall = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        wall.append(time.perf_counter() - start)
    with torch.profiler.profile() as prof:
        step()
    seconds = class_seconds(prof.key_averages())
    median = statistics.median(wall)
    profiled = sum(seconds.values())
    return {
        "shape": asdict(shape), "tokens": shape.tokens, "loss": loss, "wall_s": wall,
        "median_s": median, "tokens_per_s": shape.tokens / median,
        "class_s": {k: median * v / profiled for k, v in seconds.items()},
        "formula": formulas(shape),
    }


def measure_memory(shape: Shape) -> dict[str, Any]:
    """Resident bytes of a step above the process before the point and between steps (in a
    process on the exact heap), and the bytes saved for one micro-batch's backward."""
    gc.collect()
    floor = harness.vm_status()["VmRSS"]
    model, batch, step = build_step(shape)
    step()
    gc.collect()
    between = harness.vm_status()["VmRSS"]
    harness.reset_peak_rss()
    step()
    peak = harness.vm_status()["VmHWM"]
    saved = None
    if shape.recompute == "none":
        saved = measure_saved_bytes(model, batch[: shape.micro_batch])
    return {"peak_bytes": peak - floor, "step_bytes": peak - between, "saved_bytes": saved}
