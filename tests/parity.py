"""The parity harness: per-step loss and grad norm of a layout vs the single-process run.

Several layouts run one after another inside one group of spawned processes (start-up dominates
on CPU), each with its own mesh and run directory. A layout that sets no ``precision.*`` runs
twice: in fp32 for 20 steps, compared at 1e-4 relative (the contract), and in fp64 for 8,
compared at 1e-9, which
tells "the same math" from "the same rounding": fp32 rounding amplified by an unstable step
can drift past 1e-4 where the math is identical, and a real difference in the math cannot
hide under 1e-4 in fp64.

Beyond the two scalars per step, every run's final weights (read whole from the checkpoint it
writes at its last step, whatever its layout) must equal the reference's: in fp64 within 1e-9
element by element, in fp32 within 1e-4 in relative norm over the whole model; and the
validation loss of runs that evaluate, within the step tolerance. fp32 cannot be held to more,
nor tensor by tensor: Adam divides by sqrt(v), so a weight whose gradient is zero in exact
math (GPT-2's key bias: softmax ignores it) takes steps of about lr on pure rounding noise,
3.4e-4 relative to that tensor after 20 steps, and rare tokens' embedding rows 2.5e-5, where
the fp64 twin, whose noise stays below Adam's eps, agrees to 1e-12.

One red layout never hides another: a layout whose run raises is recorded (its traceback as
its result) and the next one still runs, the ranks kept in step by a barrier after each
layout; the comparisons collect every failing layout, rank and check (fp64 and fp32 alike)
and raise them together (:class:`Failures`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.checkpoint.model_io import read_model_tensors
from meshtron.config import load_config
from meshtron.data import build_training_data
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.training.trainer import Trainer
from tests.distributed import start_distributed

PARITY_RTOL = 1e-4
FP64_RTOL = 1e-9
WEIGHTS_RTOL = {PARITY_RTOL: 1e-4, FP64_RTOL: 1e-9}
"""How far final weights may be from the reference's, by the step tolerance of the run."""
ROUNDING_RTOL = 1e-3
"""fp32's bound for the layouts whose reductions reorder most (expert parallelism's token
dispatch, where a flipped top-k choice amplifies a last-bit difference; interleaved pipelines'
micro-batches of 2): on the Intel Xeon CPUs of 2026-12 their fp32 drift reaches 1.1e-4 to
5.3e-4 by steps 8-16 while their fp64 twins agree to 1e-9 at every step and element for
element in the final weights, so the math is the same; AMD EPYC CPUs kept them under 1e-4.
Used only where a test names it; to be understood (the parity contract says 1e-4)."""
STEPS = 20
FP64_STEPS = 8
"""The fp64 twin's steps: it tells the same math from the same rounding, and a difference in
the math shows from the first steps; the fp32 run keeps the contract's 20."""


LAYOUT_BARRIER_S = 120
"""How long a rank waits at the barrier after a layout for the others (a rank stuck in a
collective of a layout that raised elsewhere never comes: the rest of the layouts are skipped)."""


class Failures:
    """Assertion failures collected and raised together at the end, each under its name::

        failures = Failures()
        for ...:
            with failures.check(what):
                assert_parity(...)
        failures.raise_any()
    """

    def __init__(self) -> None:
        self.messages: list[str] = []

    @contextlib.contextmanager
    def check(self, what: str = "") -> Iterator[None]:
        try:
            yield
        except AssertionError as err:
            text = str(err) or "assertion failed"
            self.messages.append(text if not what or text.startswith(what) else
                                 f"{what}: {text}")

    def raise_any(self) -> None:
        if self.messages:
            count = len(self.messages)
            raise AssertionError(f"{count} failure{'s' if count > 1 else ''}:\n"
                                 + "\n".join(f"- {m}" for m in self.messages))


def test_overrides(cache_dir: str, run_dir: str, steps: int = STEPS) -> list[str]:
    """A 2-layer, 64-wide model on a 0.3 MB slice of the default corpus. A nominal
    ``train.peak_flops`` (MFU is a metric only) spares every process the start-up matmul probe
    (~2 s of CPU each, a 4-rank group's 2 cores busy for as long); the README's ``make train``
    runs the probe."""
    return [
        "--model.num_layers=2", "--model.hidden_size=64", "--model.num_heads=4",
        "--model.num_kv_heads=4", "--model.ffn_hidden_size=128", "--model.max_seq_len=64",
        "--data.vocab_size=512", "--data.corpus_max_mb=0.3", f"--data.cache_dir={cache_dir}",
        "--train.seq_len=32", "--train.global_batch=8", f"--train.steps={steps}",
        "--train.lr=0.003", "--train.min_lr=0.0003", "--train.warmup_steps=2",
        "--train.eval_every=0", "--train.log_every=5",
        "--run.progress=false", "--run.plot=false", "--checkpoint.resume=false",
        f"--run.dir={run_dir}", "--train.peak_flops=1e12",
    ]


test_overrides.__test__ = False  # a helper, not a pytest test


def warm_data_cache(cache_dir: str) -> None:
    cfg = load_config(overrides=test_overrides(cache_dir, "unused"))
    build_training_data(cfg.data, cfg.train.seq_len, cfg.train.seed, log=lambda m: None)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread for a run in the test's own process, as every rank has (restoring
    the caller's count): these tiny models' products spend most of two threads' time in the
    threads' hand-offs, and on a loaded 2-core machine far more (a one-process MoE reference:
    1.7 s on one thread, 16-27 s on two, with four other processes running)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_training(overrides: list[str], rank: int = 0, world_size: int = 1) -> dict:
    """Per-step loss and grad norm, the last validation loss, and (rank 0) the final weights
    as whole global tensors, read back from the run's last checkpoint. On one thread
    (:func:`one_thread`), also where the test's process trains a reference."""
    cfg = load_config(overrides=overrides)
    p = cfg.parallel
    mesh = ParallelMesh(MeshLayout.of(p, world_size), rank)
    with one_thread():
        result = Trainer(cfg, mesh, log=lambda m: None).run()
    weights = None
    if rank == 0 and result.checkpoint is not None:
        weights = read_model_tensors(result.checkpoint)[1]
    return {"loss": result.losses, "grad_norm": result.grad_norms, "val_loss": result.val_loss,
            "weights": weights}


def run_layout(overrides: list[str], rank: int = 0, world_size: int = 1) -> dict:
    """``run_training`` in fp32, plus an ``fp64`` result where the run fixes no precision
    setting (fp64 does not combine with bf16, fp16 or FP8)."""
    result = run_training(overrides, rank, world_size)
    if not any(o.startswith("--precision.") for o in overrides):
        run_dir = next(o for o in reversed(overrides) if o.startswith("--run.dir="))
        result["fp64"] = run_training(overrides + ["--precision.dtype=fp64", f"{run_dir}-fp64",
                                                   f"--train.steps={FP64_STEPS}"],
                                      rank, world_size)
    return result


def run_layouts(rank: int, world_size: int, cache_dir: str, root: str,
                layouts: list[list[str]]) -> list[dict]:
    """Worker body: train every layout in turn; returns one result per layout (see
    :func:`run_each`)."""
    return run_each([test_overrides(cache_dir, f"{root}/layout{i}") + layout
                     for i, layout in enumerate(layouts)], rank, world_size)


def run_each(runs: list[list[str]], rank: int, world_size: int) -> list[dict]:
    """:func:`run_layout` of each run's overrides in turn, ``{"error": traceback}`` for one
    that raised here (the next still runs), and ``{"error": ...}`` for the runs skipped once
    the ranks fell out of step."""
    results: list[dict] = []
    for i, overrides in enumerate(runs):
        try:
            results.append(run_layout(overrides, rank, world_size))
        except Exception:  # noqa: BLE001 - reported by the parent with the other layouts
            results.append({"error": traceback.format_exc()})
        if not ranks_in_step():
            skipped = {"error": f"not run: the ranks fell out of step after layout {i}"}
            return results + [skipped] * (len(runs) - i - 1)
    return results


def ranks_in_step() -> bool:
    """Whether every rank got past the same layout (a barrier that gives up after
    :data:`LAYOUT_BARRIER_S`; True outside a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=LAYOUT_BARRIER_S),
                               wait_all_ranks=True)
    except RuntimeError:
        return False
    return True


def model_overrides(layout: list[str]) -> list[str]:
    """The overrides that change the model or data, not the layout (for the reference run)."""
    layout_keys = ("--parallel.", "--train.micro_batch", "--train.recompute", "--train.compile")
    return [o for o in layout if not o.startswith(layout_keys)]


def assert_parity(reference: dict, candidate: dict, what: str, rtol: float = PARITY_RTOL) -> None:
    """Per-step loss and grad norm within ``rtol`` of the reference, and the fp64 runs (where
    the candidate has one, the reference must too) within :data:`FP64_RTOL`. Both are checked
    before either fails (one says whether the other is rounding); a run that raised fails
    with its traceback."""
    for run, name in ((reference, "the reference"), (candidate, "this layout")):
        assert "error" not in run, f"{what}: {name} raised:\n{run.get('error')}"
    failures = Failures()
    if "fp64" in candidate:
        with failures.check():
            assert "fp64" in reference, f"{what}: the reference has no fp64 run"
            assert_parity(reference["fp64"], candidate["fp64"], f"{what} [fp64]", FP64_RTOL)
    with failures.check():
        assert_same_numbers(reference, candidate, what, rtol)
    if len(failures.messages) == 1:
        raise AssertionError(failures.messages[0])
    failures.raise_any()


def assert_same_numbers(reference: dict, candidate: dict, what: str, rtol: float,
                        steps: int | None = None) -> None:
    """One precision's per-step loss and grad norm, validation loss and final weights, over
    ``steps`` steps (by default the harness's: :data:`FP64_STEPS` in fp64, else :data:`STEPS`)."""
    steps = steps or (FP64_STEPS if rtol == FP64_RTOL else STEPS)
    for key in ("loss", "grad_norm"):
        ref, got = reference[key], candidate[key]
        assert len(ref) == len(got) == steps, f"{what}: {len(got)} steps, expected {steps}"
        for step, (a, b) in enumerate(zip(ref, got), start=1):
            assert abs(a - b) <= rtol * abs(a), (
                f"{what}: {key} at step {step} is {b!r}, single process gives {a!r} "
                f"(relative difference {abs(a - b) / abs(a):.2e})"
            )
    if reference.get("val_loss") is not None or candidate.get("val_loss") is not None:
        a, b = reference["val_loss"], candidate["val_loss"]
        assert b is not None and abs(a - b) <= rtol * abs(a), f"{what}: val loss {b} vs {a}"
    if candidate.get("weights") is not None:
        assert_weights_equal(reference["weights"], candidate["weights"], what,
                             WEIGHTS_RTOL.get(rtol, rtol))


def assert_weights_equal(reference: dict, candidate: dict, what: str, rtol: float) -> None:
    """The same global tensors; in fp64 each element within ``rtol``, in fp32 all of them
    together within ``rtol`` in relative norm (see the module docstring for why not each)."""
    assert candidate.keys() == reference.keys(), f"{what}: different tensors in the checkpoint"
    squares = norms = 0.0
    for name, ref in reference.items():
        delta = candidate[name].double() - ref.double()
        squares += float(delta.square().sum())
        norms += float(ref.double().square().sum())
        if rtol <= FP64_RTOL:
            worst = float(delta.abs().max())
            assert worst <= rtol, f"{what}: final {name} differs by {worst:.2e} (allowed {rtol})"
    relative = (squares / norms) ** 0.5
    assert relative <= rtol, f"{what}: final weights differ by {relative:.2e} in relative norm"


def layout_references(layouts: list[list[str]], cache_dir: str,
                      root) -> dict[tuple[str, ...], dict]:
    """One one-process reference per model among ``layouts`` (:func:`reference_run`), keyed
    by the model's overrides; a reference that raised is kept as ``{"error": traceback}``,
    which each of its layouts then reports."""
    references: dict[tuple[str, ...], dict] = {}
    for i, layout in enumerate(layouts):
        key = tuple(model_overrides(layout))
        if key not in references:
            try:
                references[key] = reference_run(cache_dir, f"{root}/ref{i}", key)
            except Exception:  # noqa: BLE001 - each layout of this model reports it
                references[key] = {"error": traceback.format_exc()}
    return references


def assert_layouts_match(layouts: list[list[str]], results: list[list[dict]], cache_dir: str,
                         root, rtol_of=lambda layout: PARITY_RTOL,
                         references: dict[tuple[str, ...], dict] | None = None) -> None:
    """Every rank's run of every layout against one one-process reference per model
    (``rtol_of``: the fp32 bound of a layout; ``references``: :func:`layout_references`,
    trained here if not given); every layout is checked, then every failure is reported
    together."""
    if references is None:
        references = layout_references(layouts, cache_dir, root)
    failures = Failures()
    for i, layout in enumerate(layouts):
        key = tuple(model_overrides(layout))
        for rank, per_rank in enumerate(results):
            what = f"{' '.join(layout)} (rank {rank})"
            with failures.check(what):
                assert_parity(references[key], per_rank[i], what, rtol_of(layout))
    failures.raise_any()


def check_layouts(world_size: int, layouts: list[list[str]], cache_dir: str, root,
                  rtol_of=lambda layout: PARITY_RTOL, timeout: float = 300) -> None:
    """:func:`run_layouts` on ``world_size`` ranks, then :func:`assert_layouts_match`; the
    one-process references train in this process while the ranks run, not after them."""
    ranks = start_distributed(run_layouts, world_size, cache_dir, str(root), layouts,
                              timeout=timeout)
    try:
        references = layout_references(layouts, cache_dir, root)
    except BaseException:
        ranks.stop()
        raise
    assert_layouts_match(layouts, ranks.results(), cache_dir, root, rtol_of, references)


def assert_layouts_match_reference(reference: dict, layouts: list[list[str]],
                                   results: list[list[dict]]) -> None:
    """Every rank's run of every layout against one given reference (a model whose reference
    is not :func:`reference_run`'s, such as a policy's); every failure reported together."""
    failures = Failures()
    for i, layout in enumerate(layouts):
        for rank, per_rank in enumerate(results):
            what = f"{' '.join(layout)} (rank {rank})"
            with failures.check(what):
                assert_parity(reference, per_rank[i], what)
    failures.raise_any()


def reference_run(cache_dir: str, run_dir: str, model: tuple[str, ...]) -> dict:
    """:func:`run_layout` of one process for a model (its overrides), trained once per test
    session: kept in the session's data cache, whose path is part of every run's overrides,
    so each parity test of the same model (tp, dp, pp, cp, at every world size) compares with
    the same run instead of training it again (4-7 CPU-s each). A run that raises is not
    kept."""
    overrides = test_overrides(cache_dir, "-") + list(model)
    digest = hashlib.sha256("\0".join(overrides).encode()).hexdigest()[:20]
    path = Path(cache_dir) / "parity-references" / f"{digest}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    result = run_layout(test_overrides(cache_dir, run_dir) + list(model))
    path.parent.mkdir(exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(result, partial)
    partial.replace(path)
    return result

