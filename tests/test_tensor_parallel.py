"""Tensor and sequence parallelism reproduce the single-process run (the parity contract)."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.parity import assert_parity, model_overrides, run_layouts, run_training, test_overrides

LAYOUTS = {
    2: [
        ["--parallel.tp=2"],
        ["--parallel.tp=2", "--parallel.sp=true"],
        ["--parallel.tp=2", "--model.num_kv_heads=1", "--train.recompute=selective"],
        ["--parallel.tp=2", "--parallel.sp=true", "--model.arch=gpt2",
         "--model.tie_embeddings=true"],
    ],
    4: [
        ["--parallel.tp=4", "--train.recompute=full"],
        ["--parallel.tp=4", "--parallel.sp=true", "--model.num_kv_heads=2"],
        ["--parallel.tp=4", "--model.vocab_size=515", "--model.tie_embeddings=true"],
        ["--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=2"],
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_tensor_parallel_parity(world_size, data_cache, tmp_path):
    layouts = LAYOUTS[world_size]
    results = run_distributed(run_layouts, world_size, data_cache, str(tmp_path), layouts)
    for i, layout in enumerate(layouts):
        reference = run_training(
            test_overrides(data_cache, str(tmp_path / f"ref{i}")) + model_overrides(layout))
        for rank, per_rank in enumerate(results):
            assert_parity(reference, per_rank[i], f"{' '.join(layout)} (rank {rank})")
