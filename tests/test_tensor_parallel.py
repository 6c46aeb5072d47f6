"""Tensor and sequence parallelism reproduce the single-process run (the parity contract)."""

from __future__ import annotations

import pytest

from tests.parity import check_layouts

LAYOUTS = {
    2: [
        ["--parallel.tp=2"],
        ["--parallel.tp=2", "--parallel.sp=true"],
        ["--parallel.tp=2", "--model.num_kv_heads=1", "--train.recompute=selective"],
        ["--parallel.tp=2", "--parallel.sp=true", "--model.arch=gpt2",
         "--model.tie_embeddings=true"],
        ["--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_comm_overlap=true",
         "--model.num_kv_heads=1"],
    ],
    4: [
        ["--parallel.tp=4", "--train.recompute=full"],
        ["--parallel.tp=4", "--parallel.sp=true", "--model.num_kv_heads=2"],
        ["--parallel.tp=4", "--model.vocab_size=515", "--model.tie_embeddings=true"],
        ["--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=2"],
        ["--parallel.tp=4", "--parallel.sp=true", "--parallel.tp_comm_overlap=true",
         "--parallel.tp_comm_chunks=4", "--model.arch=gpt2", "--train.recompute=full"],
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_tensor_parallel_parity(world_size, data_cache, tmp_path):
    layouts = LAYOUTS[world_size]
    check_layouts(world_size, layouts, data_cache, tmp_path)
