"""Data parallelism and ZeRO 1/2: parity with one process, bytes in memory and on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtron.config import load_config
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.training.live_memory import reachable_storage_bytes
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import check_layouts, test_overrides

SMALL_BUCKETS = "--parallel.bucket_mb=0.02"  # several buckets even in the tiny test model

LAYOUTS = {
    2: [[f"--parallel.zero={z}", SMALL_BUCKETS] for z in (0, 1, 2, 3)]
    + [[f"--parallel.zero={z}", "--train.micro_batch=1", SMALL_BUCKETS] for z in (0, 1, 2, 3)]
    + [["--parallel.zero=3", "--train.recompute=full", "--model.arch=gpt2",
        "--model.tie_embeddings=true", "--train.eval_every=10"]],
    # dp=4: the sharded stages (uneven shard boundaries); ZeRO 0 and 1 are dp=2's code paths
    4: [[f"--parallel.zero={z}", "--train.global_batch=16", "--train.micro_batch=1",
         SMALL_BUCKETS] for z in (2, 3)]
    + [["--parallel.tp=2", "--parallel.sp=true", f"--parallel.zero={z}",
        "--train.micro_batch=1", SMALL_BUCKETS] for z in (1, 3)],
}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_data_parallel_parity(world_size, data_cache, tmp_path):
    layouts = LAYOUTS[world_size]
    check_layouts(world_size, layouts, data_cache, tmp_path)


def one_step_accounting(rank: int, world_size: int, cache_dir: str, root: str) -> list[dict]:
    """Per zero stage: bytes kept per rank, and (rank 0) the bytes sent in one step."""
    out = []
    for zero, reduce_dtype in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")):
        run_dir = f"{root}/z{zero}{reduce_dtype}"
        overrides = test_overrides(cache_dir, run_dir, steps=1) + [
            f"--parallel.zero={zero}", "--train.micro_batch=1", "--train.log_every=1",
            f"--precision.reduce_dtype={reduce_dtype}", SMALL_BUCKETS]
        trainer = Trainer(load_config(overrides=overrides),
                          ParallelMesh(MeshLayout(world_size), rank), log=lambda m: None)
        trainer.run()
        row = json.loads(Path(run_dir, "metrics.jsonl").read_text()) if rank == 0 else None
        units = getattr(trainer.optimizer, "units", None)  # ZeRO-3's sharded units
        out.append({
            "memory": trainer.optimizer.memory_bytes(),
            "alive": reachable_storage_bytes(trainer.model, trainer.optimizer),
            "buffers": sum(b.untyped_storage().nbytes() for b in trainer.model.buffers()),
            "tensors": len(list(trainer.model.parameters())),
            "block_bytes": [p.untyped_storage().nbytes() for block in trainer.model.blocks()
                            for p in block.parameters()],
            "params": sum(p.numel() for p in trainer.model.parameters()),
            "padded": [b.padded for b in trainer.optimizer.reducer.buckets],
            "root_padded": [f.bucket.padded for f in units.units[-1]] if units else [],
            "comm": row["comm_bytes"] if row else None,
        })
    return out


@pytest.mark.slow
def test_memory_and_bytes_follow_the_zero_formulas(data_cache, tmp_path):
    dp, fp32 = 4, 4
    results = run_distributed(one_step_accounting, dp, data_cache, str(tmp_path))
    for rank, per_stage in enumerate(results):
        for zero, r in enumerate(per_stage[:4]):
            n, padded = r["params"], sum(r["padded"])
            if zero == 0:
                expected = {"params": fp32 * n, "grads": fp32 * padded, "master": 0,
                            "optimizer": 2 * fp32 * n}
            else:  # flat (padded) parameter buffers, their own masters; 2 moments of a chunk
                expected = {"params": fp32 * padded // (dp if zero == 3 else 1),
                            "master": 0, "optimizer": 2 * fp32 * padded // dp,
                            "grads": fp32 * padded // (1 if zero == 1 else dp)}
            assert r["memory"] == expected, (rank, zero)
            # Not the optimizer's own accounting: every storage reachable from the model and
            # the optimizer (buffers aside; torch's AdamW adds a 4-byte step per tensor).
            steps = 4 * r["tensors"] if zero == 0 else 0
            assert r["alive"] == sum(r["memory"].values()) + r["buffers"] + steps, (rank, zero)
            whole = per_stage[0]["params"]  # ZeRO-3's parameters are empty between steps
            assert 0 <= padded - whole < dp * len(r["padded"])  # buckets pad to multiples of dp
            if zero == 3:  # between steps a block's parameters hold no storage at all
                assert r["block_bytes"] and not any(r["block_bytes"])
    loss_sum = 2 * 8 * (dp - 1) // dp  # the fp64 loss all-reduced over dp
    norm = 2 * fp32 * (dp - 1) // dp  # the grad-norm scalar over the whole world
    bf16 = results[0][4]  # zero 0 with precision.reduce_dtype=bf16: half the gradient bytes
    assert bf16["memory"]["grads"] == 2 * sum(bf16["padded"])
    ring_bf16 = sum(2 * p * (dp - 1) // dp for p in bf16["padded"])
    assert {k: v for k, v in bf16["comm"].items() if v} == {
        "dp_cp/all_reduce": 2 * ring_bf16 + loss_sum}
    for zero, r in enumerate(results[0][:4]):
        ring = sum(fp32 * p * (dp - 1) // dp for p in r["padded"])  # one ring pass, all buckets
        comm = {k: v for k, v in r["comm"].items() if v}
        if zero == 0:
            assert comm == {"dp_cp/all_reduce": 2 * ring + loss_sum}
        elif zero == 1:  # 2 micro-batches; only the last one communicates
            assert comm == {"dp_cp/reduce_scatter": ring, "dp_cp/all_gather": ring,
                            "dp_cp/all_reduce": loss_sum, "world/all_reduce": norm}
        elif zero == 2:  # reduce-scatter after every micro-batch
            assert comm == {"dp_cp/reduce_scatter": 2 * ring, "dp_cp/all_gather": ring,
                            "dp_cp/all_reduce": loss_sum, "world/all_reduce": norm}
        else:  # per micro-batch: the root gathered once, every block for forward and backward
            root = sum(fp32 * p * (dp - 1) // dp for p in r["root_padded"])
            gathers = 2 * (root + 2 * (ring - root))
            assert comm == {"dp_cp/reduce_scatter": 2 * ring, "dp_cp/all_gather": gathers,
                            "dp_cp/all_reduce": loss_sum, "world/all_reduce": norm}


def record_backward_events(rank: int, world_size: int, cache_dir: str) -> dict:
    """The order of gradient arrivals and bucket reductions in two backward passes."""
    import torch

    from meshtron.models.init import initialize
    from meshtron.models.transformer import Transformer
    from meshtron.optim.data_parallel import build_optimizer

    cfg = load_config(overrides=test_overrides(cache_dir, "unused") + ["--model.vocab_size=512"])
    # its own assembly: an optimizer that reports its bucket events (build_optimizer's on_event)
    model = Transformer(cfg.model)
    initialize(model, seed=0, std=0.02, num_layers=cfg.model.num_layers)
    events: list[tuple[str, int]] = []
    mesh = ParallelMesh(MeshLayout(world_size), rank)
    optimizer = build_optimizer(model, mesh, cfg.train, zero=0, bucket_mb=0.02,
                                on_event=lambda kind, b: events.append((kind, b)))
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(rank))
    out = {}
    for last in (False, True):
        events.clear()
        mesh.stats.take()
        optimizer.begin_micro_batch(last=last)
        model.loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        out[last] = {"events": list(events), "sent": sum(mesh.stats.take().values())}
        optimizer.end_micro_batch()
    out["buckets"] = len(optimizer.reducer.buckets)
    return out


@pytest.mark.slow
def test_bucket_reductions_start_while_backward_runs(data_cache):
    result = run_distributed(record_backward_events, 2, data_cache)[0]
    assert result["buckets"] >= 3
    accumulating, last = result[False], result[True]
    assert accumulating["sent"] == 0  # no communication before the last micro-batch
    assert not [e for e in accumulating["events"] if e[0] == "reduce"]
    kinds = [kind for kind, _ in last["events"]]
    first_reduce = kinds.index("reduce")
    last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
    assert first_reduce < last_grad  # a bucket was on the wire before backward finished
    assert kinds.count("reduce") == result["buckets"]
    assert last["sent"] > 0


@pytest.mark.parametrize(("overrides", "message"), [
    (["--parallel.bucket_mb=0"], "parallel.bucket_mb must be a positive number, got 0.0"),
    (["--parallel.zero=4"], "parallel.zero must be 0, 1, 2 or 3, got 4"),
])
def test_bad_data_parallel_settings(overrides, message):
    from meshtron.errors import MeshtronError

    with pytest.raises(MeshtronError, match=message):
        load_config(overrides=overrides)


def test_zero_with_one_data_parallel_rank_says_so_once(tiny_overrides):
    lines: list[str] = []
    Trainer(load_config(overrides=tiny_overrides + ["--parallel.zero=2", "--train.steps=1"]),
            log=lines.append).run()
    notes = [line for line in lines if "nothing to shard" in line]
    assert notes == ["parallel.zero=2 with a single data-parallel rank: nothing to shard, "
                     "running as zero 0"]
