"""FP8 training: the same numbers under tp, ZeRO and pipelines as in one process; close to bf16;
bad block sizes refused."""

from __future__ import annotations

import pytest

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.plan import check_run
from tests.distributed import run_distributed
from tests.parity import run_layouts, run_training, test_overrides

FP8 = {
    "tensorwise": ["--precision.fp8=tensorwise"],
    "delayed": ["--precision.fp8=delayed", "--precision.fp8_history=4"],
    "blockwise": ["--precision.fp8=blockwise", "--precision.fp8_block=16"],
}
LAYOUTS = {
    2: [["--parallel.tp=2", *FP8["tensorwise"]],
        ["--parallel.tp=2", *FP8["delayed"]],
        ["--parallel.tp=2", "--parallel.sp=true", *FP8["blockwise"]],
        ["--parallel.zero=1", "--train.micro_batch=2", *FP8["tensorwise"]],
        ["--parallel.pp=2", "--parallel.schedule=zb-h1", "--train.micro_batch=2",
         *FP8["tensorwise"]],
        ["--parallel.cp=2", *FP8["delayed"]]],  # amaxes agreed over tp x cp
}


STEPS = 10


def reference_overrides(layout: list[str]) -> list[str]:
    """The same run in one process, micro-batch size included: current scaling takes each
    micro-batch's amax, so FP8 numbers depend on how a batch is cut."""
    return [o for o in layout if not o.startswith("--parallel.")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_fp8_layouts_match_one_process_fp8(world_size, data_cache, tmp_path):
    """Amaxes agreed over tp (block-wise tiles that never cross a shard) make a split layer
    quantise exactly like the whole one: the first step matches as fp32 parity does. After
    that, summation order (tp, pipelines) moves an occasional value to the next FP8 grid point
    and those flips compound, mostly in the grad norm (E5M2 gradients carry 2 mantissa bits),
    so later steps are compared on the loss at 1e-3 (over 10 steps: FP8 emulation is slow)."""
    steps = [f"--train.steps={STEPS}"]
    layouts = [layout + steps for layout in LAYOUTS[world_size]]
    results = run_distributed(run_layouts, world_size, data_cache, str(tmp_path), layouts)
    references: dict[tuple[str, ...], dict] = {}
    for i, layout in enumerate(layouts):  # one per recipe and micro-batch (4 for 6 layouts)
        key = tuple(reference_overrides(layout))
        if key not in references:
            references[key] = run_training(
                test_overrides(data_cache, str(tmp_path / f"ref{i}")) + list(key))
    for i, layout in enumerate(layouts):
        reference = references[tuple(reference_overrides(layout))]
        for rank, got in enumerate(results):
            what = f"{' '.join(layout)} (rank {rank})"
            first = {k: abs(got[i][k][0] - reference[k][0]) / reference[k][0]
                     for k in ("loss", "grad_norm")}
            assert first["loss"] <= 1e-5 and first["grad_norm"] <= 1e-4, (what, first)
            for step, (a, b) in enumerate(zip(reference["loss"], got[i]["loss"]), 1):
                assert abs(a - b) <= 1e-3 * a, f"{what}: loss at step {step} {b} vs {a}"


@pytest.mark.slow
def test_fp8_loss_stays_within_two_percent_of_bf16(data_cache, tmp_path):
    """25 steps of the test model (the issue's 200 take many minutes on a 2-core CPU, where
    both bf16 and FP8 emulation are slow)."""
    steps = 25
    bf16 = run_training(test_overrides(data_cache, str(tmp_path / "bf16"), steps=steps)
                        + ["--precision.dtype=bf16"])["loss"]
    for name, knobs in FP8.items():
        fp8 = run_training(test_overrides(data_cache, str(tmp_path / name), steps=steps)
                           + knobs)["loss"]
        assert abs(fp8[-1] - bf16[-1]) <= 0.02 * bf16[-1], f"{name}: {fp8[-1]} vs {bf16[-1]}"


def test_blockwise_block_must_divide_the_layer_dimensions(tmp_path):
    cfg = load_config(overrides=test_overrides(str(tmp_path), str(tmp_path)) + [
        "--precision.fp8=blockwise", "--precision.fp8_block=128"])
    with pytest.raises(MeshtronError, match="model.hidden_size = 64 divisible by "
                                            "precision.fp8_block=128"):
        check_run(cfg, 1)
    cfg = load_config(overrides=test_overrides(str(tmp_path), str(tmp_path)) + [
        "--precision.fp8=blockwise", "--precision.fp8_block=64", "--parallel.tp=2"])
    with pytest.raises(MeshtronError, match=r"hidden_size / parallel.tp = 32"):
        check_run(cfg, 2)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_an_fp8_run_says_so_at_start_up(recipe, tiny_overrides):
    from meshtron.training.trainer import Trainer

    logs: list[str] = []
    Trainer(load_config(overrides=tiny_overrides + FP8[recipe]), log=logs.append)
    line = next(m for m in logs if m.startswith("fp8:"))
    assert f"fp8: {recipe} scaling in every block linear layer (gradients e5m2)" in line
    assert "emulated on CPU" in line
