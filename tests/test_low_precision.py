"""bf16/fp16 parameters with fp32 masters: memory per mode, loss curves, overflow handling."""

from __future__ import annotations

import math
import re

import pytest
import torch

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import run_training, test_overrides


def state_bytes(rank: int, world_size: int, cache: str, root: str) -> list[dict]:
    out = []
    for dtype, zero, reduce in (("bf16", 0, "fp32"), ("fp16", 1, "fp32"), ("bf16", 2, "bf16"),
                                ("bf16", 3, "fp32")):
        cfg = load_config(overrides=test_overrides(cache, f"{root}/{dtype}{zero}", steps=1) + [
            f"--precision.dtype={dtype}", f"--parallel.zero={zero}",
            f"--precision.reduce_dtype={reduce}", "--parallel.bucket_mb=0.02"])
        logs: list[str] = []
        trainer = Trainer(cfg, ParallelMesh(MeshLayout(world_size), rank), log=logs.append)
        trainer.run()
        opt = trainer.optimizer
        out.append({"memory": opt.memory_bytes(), "n": sum(p.numel() for p in opt.params),
                    "padded": sum(b.padded for b in opt.reducer.buckets),
                    "dtypes": {str(p.dtype) for p in trainer.model.parameters()},
                    "state_line": next((m for m in logs if m.startswith("state per rank")), "")})
    return out


@pytest.mark.slow
def test_state_bytes_per_rank_follow_the_formula(data_cache, tmp_path):
    """2-byte parameters; fp32 (or bf16) gradient buckets; 4-byte masters and 8-byte moments,
    divided over dp=2 from ZeRO-1 on."""
    dp = 2
    for rank, rows in enumerate(run_distributed(state_bytes, dp, data_cache, str(tmp_path))):
        for (dtype, zero, grad_bytes), r in zip((("bf16", 0, 4), ("fp16", 1, 4), ("bf16", 2, 2),
                                                 ("bf16", 3, 4)), rows):
            p = r["padded"]
            assert r["dtypes"] == {"torch.bfloat16" if dtype == "bf16" else "torch.float16"}
            shard = dp if zero else 1
            expected = {"params": 2 * p // (dp if zero == 3 else 1),
                        "grads": grad_bytes * p // (dp if zero >= 2 else 1),
                        "master": 4 * p // shard, "optimizer": 8 * p // shard}
            assert r["memory"] == expected, (rank, dtype, zero)
            if rank == 0:  # the start-up line: bytes per parameter of the model, not per
                # parameter still holding storage (none under ZeRO-3)
                per_param = float(re.search(r"params [\d.]+ MiB \(([\d.]+) B/param\)",
                                            r["state_line"]).group(1))
                expected_b = 2 / (dp if zero == 3 else 1)
                assert expected_b <= per_param < 1.1 * expected_b, r["state_line"]


@pytest.mark.slow
def test_low_precision_tracks_fp32(data_cache, tmp_path):
    """40 steps of the test model (bf16 matmuls are slow on this CPU): bf16 and fp16
    (loss-scaled) losses stay within 1% of fp32's at every step, and finish within 0.5%."""
    steps = 40
    runs = {dtype: run_training(test_overrides(data_cache, str(tmp_path / dtype), steps=steps)
                                + [f"--precision.dtype={dtype}"])["loss"]
            for dtype in ("fp32", "bf16", "fp16")}
    for dtype in ("bf16", "fp16"):
        for step, (ref, got) in enumerate(zip(runs["fp32"], runs[dtype]), 1):
            assert abs(got - ref) <= 0.01 * ref, f"{dtype} step {step}: {got} vs fp32 {ref}"
        assert abs(runs[dtype][-1] - runs["fp32"][-1]) <= 0.005 * runs["fp32"][-1]


def overflow_step(rank: int, world_size: int, cache: str, root: str) -> dict:
    cfg = load_config(overrides=test_overrides(cache, root, steps=1) + [
        "--precision.dtype=fp16", "--parallel.zero=1"])
    trainer = Trainer(cfg, ParallelMesh(MeshLayout(world_size), rank), log=lambda m: None)
    trainer.precision.scaler.scale = 2.0**40  # the scaled loss overflows fp16 gradients
    before = [p.detach().clone() for p in trainer.model.parameters()]
    masters = [m.clone() for m in trainer.optimizer.adamw.master]
    result = trainer.run()
    return {
        "grad_norm": result.grad_norms[0], "scale": trainer.precision.scaler.scale,
        "unchanged": all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
        and all(torch.equal(a, m) for a, m in zip(masters, trainer.optimizer.adamw.master)),
    }


@pytest.mark.slow
def test_fp16_overflow_is_skipped_on_every_rank(data_cache, tmp_path):
    for rank in run_distributed(overflow_step, 2, data_cache, str(tmp_path)):
        assert not math.isfinite(rank["grad_norm"])
        assert rank["scale"] == 2.0**39 and rank["unchanged"]


def test_fp16_overflow_without_loss_scaling_stops_with_a_clear_error(tiny_overrides):
    logs: list[str] = []
    trainer = Trainer(load_config(overrides=tiny_overrides + [
        "--precision.dtype=fp16", "--precision.loss_scaling=false", "--train.steps=5",
        "--train.max_skipped=2"]), log=logs.append)
    weight = next(trainer.model.parameters())
    before = weight.detach().clone()
    weight.register_hook(lambda grad: grad * math.inf)  # an overflowing fp16 gradient
    with pytest.raises(MeshtronError, match=r"^2 steps in a row up to step 2 were not finite "
                       r"\(grad norm (inf|nan)\) in fp16 without loss scaling") as err:
        trainer.run()
    assert "\n" not in str(err.value) and torch.equal(weight.detach(), before)
    assert "the weights are those of step 0. Enable precision.loss_scaling" in str(err.value)
    assert sum("skipped on every rank" in line for line in logs) == 2


def test_an_fp32_overflow_does_not_advise_loss_scaling(tiny_overrides):
    trainer = Trainer(load_config(overrides=tiny_overrides + ["--train.steps=2",
                                                              "--train.max_skipped=1"]),
                      log=lambda m: None)
    next(trainer.model.parameters()).register_hook(lambda grad: grad * math.inf)
    with pytest.raises(MeshtronError, match="in fp32 .train.max_skipped=1.; they were skipped"
                       ) as err:
        trainer.run()
    assert "loss scaling is for fp16 and would not help" in str(err.value)


def test_fp64_keeps_every_state_in_fp64(tiny_overrides):
    """Verification runs: fp64 parameters, gradient buckets and AdamW moments (8 + 8 + 16
    bytes per parameter at ZeRO 0, no masters)."""
    cfg = load_config(overrides=tiny_overrides + ["--precision.dtype=fp64", "--train.steps=2"])
    trainer = Trainer(cfg, log=lambda m: None)
    result = trainer.run()
    opt = trainer.optimizer
    n, padded = sum(p.numel() for p in opt.params), sum(b.padded for b in opt.reducer.buckets)
    assert {p.dtype for p in opt.params} == {torch.float64}
    assert {b.grad.dtype for b in opt.reducer.buckets} == {torch.float64}
    assert opt.memory_bytes() == {"params": 8 * n, "grads": 8 * padded, "master": 0,
                                  "optimizer": 16 * n}
    assert all(math.isfinite(x) for x in result.losses + result.grad_norms)


def interrupted_and_whole(rank: int, world_size: int, cache: str, root: str) -> dict:
    """Per dtype under dp=2 ZeRO-1: an 8-step run, and the same run crashed after its step-4
    checkpoint and resumed by a new trainer. fp16 starts from a loss scale that overflows, so
    the saved scale (and count of clean steps) is not the default one."""
    from tests.test_trainer import CrashAfterSave, Interrupted

    mesh = ParallelMesh(MeshLayout(world_size), rank)
    out = {}
    for dtype in ("bf16", "fp16"):
        def trainer(kind: type[Trainer], name: str, *extra: str, dtype: str = dtype) -> Trainer:
            made = kind(load_config(overrides=test_overrides(cache, f"{root}/{dtype}", steps=8)
                                    + [f"--precision.dtype={dtype}", "--parallel.zero=1",
                                       f"--checkpoint.dir={root}/{dtype}/{name}", *extra]),
                        mesh, log=lambda m: None)
            if made.precision.scaler is not None and not made.step:
                made.precision.scaler.scale = 2.0**22
            return made

        def state(t: Trainer) -> dict:
            scaler = t.precision.scaler
            return {"masters": [m.clone() for m in t.optimizer.adamw.master],
                    "moments": [v.clone() for m in t.optimizer.adamw.moments for v in m.values()],
                    "scale": (scaler.scale, scaler.clean_steps) if scaler else None}

        whole = trainer(Trainer, "whole")
        whole_result = whole.run()
        part = trainer(CrashAfterSave, "part", "--checkpoint.every=4")
        part.crash_at = 4
        with pytest.raises(Interrupted):
            part.run()
        resumed = trainer(Trainer, "part", "--checkpoint.every=4", "--checkpoint.resume=true")
        at_resume = state(resumed)
        result = resumed.run()
        out[dtype] = {"whole": (whole_result.losses, whole_result.grad_norms, state(whole)),
                      "crashed": state(part), "at_resume": at_resume,
                      "resumed": (result.losses, result.grad_norms, state(resumed))}
    return out


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a["scale"] == b["scale"], what
    for key in ("masters", "moments"):
        assert len(a[key]) == len(b[key]) > 0, what
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), f"{what}: {key}"


@pytest.mark.slow
def test_low_precision_resume_under_zero1_is_bit_identical(data_cache, tmp_path):
    for rank, per_dtype in enumerate(run_distributed(interrupted_and_whole, 2, data_cache,
                                                     str(tmp_path))):
        for dtype, run in per_dtype.items():
            what = f"{dtype} rank {rank}"
            _assert_same_state(run["crashed"], run["at_resume"], f"{what} restored")
            losses, norms, final = run["whole"]
            resumed_losses, resumed_norms, resumed_final = run["resumed"]
            assert resumed_losses == losses[4:] and resumed_norms == norms[4:], what
            _assert_same_state(final, resumed_final, f"{what} final")
            if dtype == "fp16":
                assert run["crashed"]["scale"][0] < 2.0**22, "no overflow: the scale is untested"
