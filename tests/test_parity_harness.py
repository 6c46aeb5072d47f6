"""The parity harness itself: one red layout never hides another.

A layout whose run raises on the workers is recorded and the next layout still runs; the
comparison reports every failing layout and rank, and both precisions of one layout, at once.
"""

from __future__ import annotations

import pytest

from tests.parity import (
    FP64_STEPS,
    STEPS,
    Failures,
    assert_layouts_match,
    assert_parity,
    run_layouts,
)

LAYOUTS = [["--parallel.tp=3", "--model.num_heads=5"],
           ["--parallel.pp=4", "--model.num_kv_heads=3"]]
"""Two layouts that fail, each its own way, and whose one-process
references (the model settings alone) fail too: everything here fails in the config checks,
so nothing trains."""


def test_every_layout_runs_and_every_failure_is_reported(data_cache, tmp_path):
    """In one process (the 2-rank path, with its barrier after each layout, runs in every
    parity test): the second layout runs after the first raised, and the report names both,
    for each rank, with the references that raised too."""
    results = [run_layouts(0, 1, data_cache, str(tmp_path), LAYOUTS)] * 2  # two "ranks"
    for per_rank in results:
        first, second = (r["error"] for r in per_rank)
        assert "MeshtronError" in first and "num_heads=5" in first
        assert "MeshtronError" in second and "num_kv_heads=3" in second  # ran after the first
    with pytest.raises(AssertionError) as err:
        assert_layouts_match(LAYOUTS, results, data_cache, tmp_path / "refs")
    report = str(err.value)
    assert report.startswith("4 failures:")
    for layout in LAYOUTS:
        for rank in (0, 1):
            assert f"{' '.join(layout)} (rank {rank}): the reference raised" in report


def run(loss: float, steps: int) -> dict:
    return {"loss": [loss] * steps, "grad_norm": [1.0] * steps, "val_loss": None}


def test_both_precisions_of_a_layout_are_checked_before_it_fails():
    """fp32 and its fp64 twin both off: the report names both, and the step of each."""
    reference = {**run(2.0, STEPS), "fp64": run(2.0, FP64_STEPS)}
    candidate = {**run(2.1, STEPS), "fp64": run(2.0 + 1e-6, FP64_STEPS)}
    with pytest.raises(AssertionError) as err:
        assert_parity(reference, candidate, "tp=2")
    report = str(err.value)
    assert report.startswith("2 failures:")
    assert "tp=2 [fp64]: loss at step 1 is 2.000001" in report
    assert "tp=2: loss at step 1 is 2.1" in report
    assert_parity(reference, {**run(2.0, STEPS), "fp64": run(2.0, FP64_STEPS)}, "same")


def test_failures_collect_then_raise_together():
    failures = Failures()
    for name in ("a", "b", "c"):
        with failures.check(name):
            if name != "b":
                raise AssertionError(f"{name} is red")
    with pytest.raises(AssertionError, match=r"^2 failures:\n- a is red\n- c is red$"):
        failures.raise_any()
    Failures().raise_any()  # none: nothing raised
