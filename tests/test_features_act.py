"""Features that parity alone would not notice if they did nothing: zero-bubble pipelines
really defer weight gradients, FP8 really quantises every block linear layer, asynchronous
saves really run in the background."""

from __future__ import annotations

import threading

import pytest
import torch

from meshtron.checkpoint import saver as saver_module
from meshtron.checkpoint.saver import CheckpointSaver
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.models.transformer import Transformer
from meshtron.optim.data_parallel import build_optimizer
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import test_overrides

# ------------------------------------------------------------------ zero-bubble pipelines


def gradient_actions(rank: int, world: int, cache: str, root: str) -> dict:
    """One zb-h1 step on pp=2: the parameters whose gradients reach their bucket in each B and
    each W action of this stage, and the parameters whose weight gradient may be deferred."""
    cfg = load_config(overrides=test_overrides(cache, f"{root}/zb", steps=1) + [
        "--parallel.pp=2", "--parallel.schedule=zb-h1", "--train.micro_batch=2",
        "--model.arch=gpt2", "--parallel.bucket_mb=0.000001"])  # a bucket per parameter
    trainer = Trainer(cfg, ParallelMesh(MeshLayout(world, pp=2), rank), log=lambda m: None)
    model = trainer.model
    names = {id(p): n for n, p in model.named_parameters()}
    reducer = trainer.optimizer.reducer
    owner = {b.index: names[id(b.params[0])] for b in reducer.buckets}
    assert all(len(b.params) == 1 for b in reducer.buckets)
    events: list[str | None] = []
    reducer.on_event = lambda kind, index: events.append(owner[index]) if kind == "grad" else None
    begin = trainer.optimizer.begin_micro_batch

    def marked(last: bool) -> None:
        events.append(None)  # one gradient-producing action starts
        begin(last)

    trainer.optimizer.begin_micro_batch = marked
    trainer.run()
    segments: list[list[str]] = []
    for event in events:
        if event is None:
            segments.append([])
        else:
            segments[-1].append(event)
    kinds = [a.kind for a in trainer.pipeline.actions if a.kind in ("B", "W")]
    linear = {n for n, m in model.named_modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    deferred = {f"{n}.weight" for n in linear if n != "output"}
    if model.has_head:
        deferred.add("output.weight" if hasattr(model, "output") else "embed.weight")
    return {"kinds": kinds, "segments": segments, "deferred": sorted(deferred)}


@pytest.mark.slow
def test_zero_bubble_backward_leaves_weight_gradients_to_w(data_cache, tmp_path):
    for stage in run_distributed(gradient_actions, 2, data_cache, str(tmp_path)):
        deferred = set(stage["deferred"])
        assert len(stage["kinds"]) == len(stage["segments"]) and "W" in stage["kinds"]
        seen_in_w: set[str] = set()
        for kind, names in zip(stage["kinds"], stage["segments"]):
            if kind == "B":  # input gradients, norms, biases, embeddings: no linear weight
                assert not deferred & set(names), (kind, sorted(deferred & set(names)))
            else:
                assert names and set(names) <= deferred, (kind, names)
                seen_in_w |= set(names)
        assert seen_in_w == deferred


# ------------------------------------------------------------------ FP8


def test_fp8_quantises_every_block_linear_and_changes_the_numbers(data_cache, tmp_path):
    losses = {}
    for recipe in ("none", "tensorwise"):
        cfg = load_config(overrides=test_overrides(data_cache, str(tmp_path / recipe), steps=1)
                          + [f"--precision.fp8={recipe}"])
        trainer = Trainer(cfg, log=lambda m: None)
        counts: dict[str, int] = {}  # (layer:role) -> scales asked for
        for name, module in trainer.model.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                in_block = name.startswith("layers.")
                assert (module.fp8 is not None) == (in_block and recipe != "none"), name
                if module.fp8 is not None:
                    scales = module.fp8.recipe.scales

                    def counted(x, role, fmt, name=name, scales=scales, counts=counts):
                        counts[f"{name}:{role}"] = counts.get(f"{name}:{role}", 0) + 1
                        return scales(x, role, fmt)

                    module.fp8.recipe.scales = counted
        losses[recipe] = trainer.run().losses[0]
        if recipe != "none":
            blocks = [n for n, m in trainer.model.named_modules()
                      if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                      and n.startswith("layers.")]
            for name in blocks:  # quantised in forward (input, weight) and backward (grad)
                for role in ("input", "weight", "grad_output"):
                    assert counts.get(f"{name}:{role}", 0) >= 1, (name, role)
    assert losses["tensorwise"] != losses["none"]
    assert abs(losses["tensorwise"] - losses["none"]) < 0.01 * losses["none"]


# ------------------------------------------------------------------ asynchronous saves


def test_async_save_runs_in_the_background_one_at_a_time(tmp_path, monkeypatch):
    release = threading.Event()
    written: list[int] = []

    def slow_write(directory, rank, pieces, rng):
        assert release.wait(10)
        written.append(len(pieces))

    monkeypatch.setattr(saver_module, "write_shard", slow_write)
    monkeypatch.setattr(saver_module, "finalize_checkpoint", lambda *a, **k: None)
    saver = CheckpointSaver(tmp_path, 0, 1, "tok", keep_last=2, asynchronous=True)
    saver.save(1, [], {}, {})
    assert not written  # returned while the writer is blocked (until released below)
    assert saver.pending is not None and not saver.pending[1].done()
    threading.Timer(0.3, release.set).start()
    saver.save(2, [], {}, {})  # waits for the first save: never two in flight
    assert written == [0]
    saver.close()
    assert written == [0, 0]


def test_a_background_capture_holds_back_only_the_next_update(tmp_path, monkeypatch):
    """The saver's thread copies the state; the optimizer's next update, and nothing before
    it, waits for that copy."""
    monkeypatch.setattr(saver_module, "write_shard", lambda *args: None)
    monkeypatch.setattr(saver_module, "finalize_checkpoint", lambda *a, **k: None)
    release, events = threading.Event(), []

    def capture() -> list:
        assert release.wait(10)
        events.append("captured")
        return []

    cfg = load_config(overrides=["--model.preset=tiny", "--model.num_layers=1",
                                 "--model.vocab_size=64"])
    mesh = ParallelMesh.single()  # an optimizer alone (its update fence), no rank to train
    optimizer = build_optimizer(Transformer(cfg.model, mesh), mesh, cfg.train, zero=0,
                                bucket_mb=1.0)
    optimizer.step = lambda lr: events.append(f"update {lr}")  # what the fence guards
    saver = CheckpointSaver(tmp_path, 0, 1, "tok", keep_last=2, asynchronous=True)
    optimizer.fence_next_update(saver.wait_captured)
    saver.save(1, capture, {}, {})
    assert not saver.captured.is_set()  # the copy has not run: training goes on
    threading.Timer(0.2, release.set).start()
    optimizer.update(0.5)  # blocks until the capture is done
    optimizer.update(0.25)  # the fence held one update only
    assert events == ["captured", "update 0.5", "update 0.25"]
    saver.close()


def test_a_failed_background_save_stops_the_next_step(tmp_path, monkeypatch):
    def failing_write(directory, rank, pieces, rng):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saver_module, "write_shard", failing_write)
    saver = CheckpointSaver(tmp_path, 0, 1, "tok", keep_last=2, asynchronous=True)
    saver.save(4, [], {}, {})
    assert isinstance(saver.pending[1].exception(), OSError)  # waits for the writer's end
    with pytest.raises(MeshtronError, match=r"saving the checkpoint of step 4 under .* failed "
                       r"\(no space left on the device\)"):
        saver.check()  # what the trainer calls at the start of every step
    saver.close()


def test_async_training_save_matches_and_is_backgrounded(data_cache, tmp_path, monkeypatch):
    """Through the trainer: with checkpoint.async the step loop goes on while the writer is
    blocked, and the save completes before the run returns."""
    release = threading.Event()
    real = saver_module.write_shard
    steps_while_blocked: list[int] = []

    def gated(directory, rank, pieces, rng):
        assert release.wait(30)
        real(directory, rank, pieces, rng)

    monkeypatch.setattr(saver_module, "write_shard", gated)
    cfg = load_config(overrides=test_overrides(data_cache, str(tmp_path / "run"), steps=4)
                      + ["--checkpoint.async=true", "--checkpoint.every=2"])
    trainer = Trainer(cfg, log=lambda m: None)
    original = trainer.saver.check

    def check() -> None:
        if trainer.saver.pending is not None and not trainer.saver.pending[1].done():
            steps_while_blocked.append(trainer.step)
            if trainer.step == 3:
                release.set()
        original()

    trainer.saver.check = check
    result = trainer.run()
    assert steps_while_blocked == [2, 3]  # steps 3 and 4 ran during the step-2 save
    assert result.checkpoint.is_dir() and (tmp_path / "run/checkpoints/step_00000002").is_dir()
    assert torch.isfinite(torch.tensor(result.losses)).all()
