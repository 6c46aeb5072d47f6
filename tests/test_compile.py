"""``train.compile=true``: compiled blocks reproduce the eager single-process run (the parity
contract), in one process and under tp + sp (overlapped) and pp."""

from __future__ import annotations

import pytest

from meshtron.config import load_config
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import (
    assert_layouts_match,
    assert_parity,
    run_layout,
    run_layouts,
    test_overrides,
)

FP32 = ["--precision.dtype=fp32"]  # no fp64 twin: one compile per run
COMPILED = ["--train.compile=true", *FP32]
LAYOUTS = [
    ["--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_comm_overlap=true", *COMPILED],
    ["--parallel.pp=2", "--train.micro_batch=2", *COMPILED],
]


@pytest.mark.slow
def test_compiled_blocks_match_eager(data_cache, tmp_path):
    reference = run_layout(test_overrides(data_cache, str(tmp_path / "eager")) + FP32)
    lines: list[str] = []
    cfg = load_config(overrides=test_overrides(data_cache, str(tmp_path / "one")) + COMPILED)
    result = Trainer(cfg, ParallelMesh(MeshLayout(1), 0), log=lines.append).run()
    assert_parity(reference, {"loss": result.losses, "grad_norm": result.grad_norms},
                  "one process, compiled")
    assert any(line.startswith("train.compile: the first step took") for line in lines)
    results = run_distributed(run_layouts, 2, data_cache, str(tmp_path), LAYOUTS, timeout=600)
    assert_layouts_match(LAYOUTS, results, data_cache, tmp_path)
