"""``train.compile=true``: compiled blocks reproduce the eager single-process run (the parity
contract), in one process and under tp + sp (overlapped), pp and ZeRO-3; compiled FP8 meets
FP8's own standard (``tests/test_fp8_training.py``)."""

from __future__ import annotations

import pytest

from meshtron.config import load_config
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import (
    assert_parity,
    model_overrides,
    one_thread,
    run_layout,
    run_layouts,
    run_training,
    test_overrides,
)

FP32 = ["--precision.dtype=fp32"]  # no fp64 twin: one compile per run
COMPILED = ["--train.compile=true", *FP32]
LAYOUTS = [
    ["--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_comm_overlap=true", *COMPILED],
    ["--parallel.pp=2", "--train.micro_batch=2", *COMPILED],
    ["--parallel.zero=3", "--train.micro_batch=2", *COMPILED],  # gathers and frees stay eager
]


@pytest.mark.slow
def test_compiled_blocks_match_eager(data_cache, tmp_path):
    reference = run_layout(test_overrides(data_cache, str(tmp_path / "eager")) + FP32)
    lines: list[str] = []
    cfg = load_config(overrides=test_overrides(data_cache, str(tmp_path / "one"))
                      + ["--train.micro_batch=2", *COMPILED])
    # micro-batches of 2, as the pp and ZeRO-3 layouts below: their ranks find this block's
    # graph in Inductor's cache instead of compiling it again (~30% of the test's CPU-s cold)
    with one_thread():  # as the ranks: the graphs they compile are then this one's
        result = Trainer(cfg, ParallelMesh(MeshLayout(1), 0), log=lines.append).run()
    assert_parity(reference, {"loss": result.losses, "grad_norm": result.grad_norms},
                  "one process, compiled")
    assert any(line.startswith("train.compile: the first step took") for line in lines)
    results = run_distributed(run_layouts, 2, data_cache, str(tmp_path), LAYOUTS, timeout=600)
    # every layout's model is the reference's (assert_layouts_match would train it again)
    assert all(model_overrides(layout) == FP32 for layout in LAYOUTS)
    for i, layout in enumerate(LAYOUTS):
        for rank, per_rank in enumerate(results):
            assert_parity(reference, per_rank[i], f"{' '.join(layout)} (rank {rank})")


@pytest.mark.slow
def test_compiled_fp8_meets_the_fp8_standard(data_cache, tmp_path):
    """The first step as fp32 parity, then the loss within 1e-3 (occasional FP8 grid flips
    compound, as between layouts)."""
    fp8 = ["--precision.fp8=tensorwise", "--train.steps=10"]
    eager = run_training(test_overrides(data_cache, str(tmp_path / "eager")) + fp8)
    compiled = run_training(test_overrides(data_cache, str(tmp_path / "compiled")) + fp8
                            + ["--train.compile=true"])
    for key, bound in (("loss", 1e-5), ("grad_norm", 1e-4)):
        assert abs(compiled[key][0] - eager[key][0]) <= bound * eager[key][0], key
    for step, (a, b) in enumerate(zip(eager["loss"], compiled["loss"]), 1):
        assert abs(a - b) <= 1e-3 * a, f"loss at step {step}: compiled {b}, eager {a}"
