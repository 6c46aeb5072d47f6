"""LoRA under every axis: per-step loss, grad norm and final adapters of each layout against
one process, fp64 to 1e-9 (the adapters split like their base layers, see
meshtron/parallel/tensor/lora.py)."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.parity import FP64_RTOL, assert_layouts_match, run_layouts

LORA = ["--model.lora.rank=4", "--model.lora.alpha=8", "--model.num_kv_heads=1",
        "--train.lr=0.02", "--precision.dtype=fp64", "--train.steps=8"]
"""One model for every layout (so one reference): one kv head, shared by both tp ranks (its
adapter's B replicated over them); fp64 and 8 steps, compared at 1e-9."""

LAYOUTS = [
    LORA + ["--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=1",
            "--train.micro_batch=2", "--parallel.bucket_mb=0.001"],
    LORA + ["--parallel.pp=2", "--parallel.tp=2", "--parallel.schedule=zb-h1",
            "--train.micro_batch=2"],
    LORA + ["--parallel.cp=2", "--parallel.zero=3", "--parallel.bucket_mb=0.001"],
]
"""tp + sp (kv shared) with dp, ZeRO-1 and two micro-batches; pp x tp on a zero-bubble
schedule (the frozen weights defer no gradient); cp with dp and ZeRO-3 (only the adapters
sharded)."""


@pytest.mark.slow
def test_lora_parity_every_axis(data_cache, tmp_path):
    results = run_distributed(run_layouts, 4, data_cache, str(tmp_path), LAYOUTS, timeout=2400)
    assert_layouts_match(LAYOUTS, results, data_cache, tmp_path,
                         rtol_of=lambda layout: FP64_RTOL)
