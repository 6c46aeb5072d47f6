"""MXFP8 and NVFP4 training: the same numbers under tp (with sp), pipelines, dp/ZeRO (ZeRO-3
with the FP8 and FP4 parameter gathers too), cp and ep as in one process; the per-layer policy; the
contract's flags and bad input refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import traceback
from pathlib import Path

import pytest

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.plan import check_run
from meshtron.precision.nvfp4 import NVFP4Options
from meshtron.precision.recipes import FP8Options
from tests.distributed import run_distributed, run_python
from tests.parity import (
    FP64_RTOL,
    Failures,
    assert_same_numbers,
    assert_weights_equal,
    one_thread,
    reference_run,
    run_layouts,
    test_overrides,
)

MX = ["--precision.fp8=mxfp8"]
NV = ["--precision.fp4=nvfp4"]
MB2 = "--train.micro_batch=2"
MOE = ["--model.moe.num_experts=4", "--model.moe.top_k=2"]
GATHER = "--precision.fp8_param_gather=true"
FP64 = "--precision.dtype=fp64"
LAYOUTS = [
    ["--parallel.tp=2", "--parallel.sp=true", MB2, *MX],
    ["--parallel.zero=1", MB2, *MX],
    ["--parallel.zero=3", MB2, GATHER, *MX],
    ["--parallel.cp=2", "--train.seq_len=128", "--model.max_seq_len=128", *MX],
    ["--parallel.ep=2", *MOE, MB2, *MX],
    ["--parallel.tp=2", "--parallel.sp=true", MB2, *NV],
    ["--parallel.pp=2", "--parallel.schedule=zb-h1", MB2, "--precision.keep_layers=0", *NV],
    ["--parallel.zero=3", MB2, GATHER, *NV],
    ["--parallel.cp=2", "--train.seq_len=64", *NV],
    ["--parallel.ep=2", *MOE, MB2, *NV],
]
"""Every recipe under every axis. Micro-batches of 2 sequences where the layout allows (the
one-process reference keeps the micro-batch: current scaling and the token blocks of the
weight gradient are per micro-batch), so layouts of one model share a reference. Each NVFP4
layout also runs in fp64 (:func:`fp64_twins`)."""
STEPS = 3
"""Step 1 proves forward and backward (loss and grad norm), steps 2 and 3 the update and what
is formed again from the updated weights (the gathered FP8 weights, Adam's second step)."""


def fp64_twins(layouts: list[list[str]]) -> list[list[str]]:
    """The NVFP4 layouts again with fp64 products, compared at 1e-9. In fp32 a layout's own
    summation order moves a value across a rounding threshold of the FP4 grid about once in
    600,000 elements (a step here quantises ~590,000 gradient elements stochastically), and
    one such flip grows through the backward and Adam: on an AMD EPYC the tp=2 layout's final
    weights were 1.2e-2 from one process's after 3 steps, with stochastic rounding off 1.0e-6,
    and its fp64 twin 4e-16. fp64 leaves the quantisation itself in fp32, so the twin checks
    the same numbering of draws, scales and gathers, without the flips' noise."""
    return [layout + [FP64] for layout in layouts if NV[0] in layout]


def reference_of(layout: list[str]) -> tuple[str, ...]:
    """The one-process run a layout is compared with: its overrides less the layout's. NVFP4
    layers compute with the single quantisation of their weights whether or not ZeRO-3
    gathers them in FP4, so an NVFP4 layout's reference also drops the gather setting (one
    run fewer, and the claim checked)."""
    nvfp4 = NV[0] in layout
    return tuple(o for o in layout if not o.startswith("--parallel.")
                 and not (nvfp4 and o == GATHER))


def layouts_and_references(rank: int, world_size: int, cache_dir: str, root: str,
                           layouts: list[list[str]], references: list[tuple[str, ...]]
                           ) -> tuple[list[dict], dict[int, dict]]:
    """Worker body: every layout on the group, then the one-process references shared out
    over the ranks (each a one-process mesh), so the 2 cores train them side by side."""
    results = run_layouts(rank, world_size, cache_dir, root, layouts)
    mine = {}
    for j in range(rank, len(references), world_size):
        try:
            mine[j] = reference_run(cache_dir, f"{root}/ref{j}", references[j])
        except Exception:  # noqa: BLE001 - reported with the layouts that compare with it
            mine[j] = {"error": traceback.format_exc()}
    return results, mine


@pytest.mark.slow
def test_mxfp8_and_nvfp4_layouts_match_one_process(data_cache, tmp_path):
    """Block scales never cross a shard (the plan holds every tp-local width, and each cp
    chunk, to whole blocks; an expert's token blocks restart at each ep source's rows),
    NVFP4's per-tensor amaxes are agreed over tp and cp, and its stochastic rounding draws by
    global token and feature numbers: a split layer quantises like the whole one. In fp32 the
    first step's loss matches as fp32 parity does and later steps' at 1e-3 (summation order
    may move an occasional value to the next grid point), as the FP8 recipes' test does; each
    NVFP4 layout's fp64 twin matches in every step and weight at 1e-9. Every layout is
    checked and every failure reported together."""
    layouts = [layout + [f"--train.steps={STEPS}"] for layout in LAYOUTS]
    layouts += fp64_twins(layouts)
    references = list(dict.fromkeys(reference_of(layout) for layout in layouts))
    ranks = run_distributed(layouts_and_references, 2, data_cache, str(tmp_path), layouts,
                            references, timeout=900)
    refs = {j: ref for _, mine in ranks for j, ref in mine.items()}
    failures = Failures()
    for i, layout in enumerate(layouts):
        reference = refs[references.index(reference_of(layout))]
        for rank, (results, _) in enumerate(ranks):
            what = " ".join(layout) + f" (rank {rank})"
            with failures.check(what):
                assert "error" not in reference, ("reference", reference.get("error"))
                assert "error" not in results[i], results[i].get("error")
                if FP64 in layout:  # planted, caught only here: cp's tokens or tp's
                    # output features numbered locally (loss 1.1e-4 / 1.7e-4 off at step 2)
                    assert_same_numbers(reference, results[i], what, FP64_RTOL, steps=STEPS)
                else:
                    assert_close(reference, results[i], what, fp4=NV[0] in layout)
    failures.raise_any()


def assert_close(reference: dict, got: dict, what: str, fp4: bool) -> None:
    """Step 1's loss within 1e-5 of one process, every step's loss within 1e-3. MXFP8 also:
    step 1's grad norm within 1e-5 (measured: at most 2.5e-6, under cp) and the final weights
    (rank 0 reads them whole) within 1e-2 in relative norm (measured: at most 2.1e-3, under
    cp, where flips to the next grid point compound through Adam). NVFP4's flips are coarser
    (its step-1 grad norm 9.5e-6 off under tp on an AMD EPYC, its weights 1.2e-2): its fp64
    twin holds those to 1e-9 instead (:func:`fp64_twins`)."""
    first = {k: abs(got[k][0] - reference[k][0]) / reference[k][0]
             for k in ("loss",) + ("grad_norm",) * (not fp4)}
    assert max(first.values()) <= 1e-5, f"step 1: {first}"
    assert len(got["loss"]) == len(reference["loss"]) == STEPS, len(got["loss"])
    for step, (a, b) in enumerate(zip(reference["loss"], got["loss"]), 1):
        assert abs(a - b) <= 1e-3 * a, f"loss at step {step} {b} vs {a}"
    if got.get("weights") is not None and not fp4:
        assert_weights_equal(reference["weights"], got["weights"], what, 1e-2)


def test_the_policy_keeps_chosen_blocks_in_high_precision(tiny_overrides):
    """keep_layers=0,-1 keeps the first and last of 4 blocks out; fp4_layers=1 puts block 1 in
    NVFP4 and leaves block 2 to the FP8 recipe; the output layer is never quantised."""
    from meshtron.training.trainer import Trainer

    cfg = load_config(overrides=tiny_overrides + [
        "--model.num_layers=4", "--precision.keep_layers=0,-1", "--precision.fp4_layers=1",
        *NV, *MX])
    model = Trainer(cfg, log=lambda message: None).model
    kinds = {i: {type(m.fp8) for m in block.modules() if hasattr(m, "fp8")}
             for i, block in enumerate(model.blocks())}
    assert kinds == {0: {type(None)}, 1: {NVFP4Options}, 2: {FP8Options}, 3: {type(None)}}
    assert not hasattr(model.output, "fp8") or model.output.fp8 is None


@pytest.mark.slow  # 4-8 s on shared cores
def test_moe_experts_follow_their_blocks_format(tiny_overrides):
    """Under precision.fp8=mxfp8 the routed experts' grouped products are MXFP8 too, except in
    a kept block; a 2-step MoE run trains (finite, falling loss)."""
    from meshtron.precision.mx import MXExperts
    from meshtron.training.trainer import Trainer

    moe = ["--model.moe.num_experts=4", "--model.moe.top_k=2", "--precision.keep_layers=0",
           "--train.steps=2", *MX]
    trainer = Trainer(load_config(overrides=tiny_overrides + moe), log=lambda message: None)
    kinds = {i: type(layer.low_precision) for i, layer in trainer.model.moe_layers().items()}
    assert kinds == {0: type(None), 1: MXExperts}
    with one_thread():
        losses = trainer.run().losses
    assert losses[-1] < losses[0] and all(loss == loss for loss in losses)


@pytest.mark.parametrize("overrides, message", [
    (["--model.hidden_size=48", "--model.num_heads=3", "--model.num_kv_heads=3", *MX],
     "precision.fp8=mxfp8 needs model.hidden_size = 48 divisible by its block of 32"),
    (["--parallel.tp=2", "--model.ffn_hidden_size=72", *NV],
     "precision.fp4=nvfp4 needs model.ffn_hidden_size / parallel.tp = 36 divisible by its "
     "block of 16"),
    (["--precision.keep_layers=-1", "--precision.fp4_layers=0,1", *NV],
     "precision.fp4_layers puts block 1 in FP4, but precision.keep_layers keeps it in high "
     "precision"),
    (["--precision.fp4_layers=0"], "precision.fp4_layers chooses the blocks in FP4"),
    (["--precision.keep_layers=2", *MX], "names block 2, but the model has blocks 0..1"),
    (["--precision.dtype=fp16", *NV], r"train with bf16 \(or fp32\) parameters, not "
     "precision.dtype=fp16"),
    (["--parallel.cp=2", *MX], "parallel.cp=2 with precision.fp8=mxfp8: its weight-gradient"),
    (["--precision.fp4=nvfp2"], "precision.fp4='nvfp2' is not one of none, nvfp4"),
    (["--precision.fp8_param_gather=true"], "precision.fp8_param_gather gathers the weights "
     "of the FP8/FP4 blocks' linear layers: set precision.fp8 or precision.fp4 too"),
    (["--model.moe.num_experts=4", "--model.moe.top_k=2", "--parallel.cp=2",
      "--train.seq_len=128", "--model.max_seq_len=128", *MX],
     "quantises each expert's weight gradient in blocks of 32 of its tokens, which "
     "parallel.cp=2 splits"),
    (["--parallel.cp=2", "--train.seq_len=32", *NV], "parallel.cp=2 with precision.fp4=nvfp4: "
     r"its weight-gradient tiles .* a train.seq_len that is a multiple of 64"),
])
def test_bad_low_precision_settings_are_one_line(overrides, message, tmp_path):
    cfg_overrides = test_overrides(str(tmp_path), str(tmp_path)) + overrides
    with pytest.raises(MeshtronError, match=message) as info:
        check_run(load_config(overrides=cfg_overrides), 2 if any(
            o.endswith("=2") and o.startswith("--parallel.") for o in overrides) else 1)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_meshtron_train_takes_the_contracts_flags(tiny_overrides):
    """``--precision.fp8=mxfp8`` and ``--precision.fp4=nvfp4`` with bf16 train from the
    command line and say so at start-up; a layer shape the recipe cannot take exits 2 with
    one line."""
    base = ["-m", "meshtron", "train", *tiny_overrides, "--train.steps=2",
            "--precision.dtype=bf16"]

    def meshtron(args: list[str]) -> subprocess.CompletedProcess:  # forked, torch imported
        return run_python(base + args, Path.cwd(), dict(os.environ), timeout=600)

    for flag, said in ((MX, "mxfp8"), (NV, "nvfp4")):
        done = meshtron(flag)
        assert done.returncode == 0, done.stderr[-2000:]
        assert said in done.stdout, done.stdout
    bad = meshtron(MX + ["--model.hidden_size=48", "--model.num_heads=3",
                         "--model.num_kv_heads=3"])
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "divisible by its block of 32" in bad.stderr


def test_tune_prices_each_format_at_its_profiles_peak(capsys, tmp_path):
    """On a B200 (FP4 and FP8 peaks in its data sheet) the same pinned layout steps faster in
    MXFP8 than in bf16 and faster still in NVFP4; an H100 has no FP4 peak, so NVFP4 is priced
    at FP8's; GB200's node is its 72-GPU NVLink domain."""
    from meshtron.costmodel.problem import Cluster, problem_of
    from meshtron.costmodel.profiles import builtin_profiles
    from tests.test_tuner import tune

    times = {}
    for name, knobs in (("bf16", []), ("mxfp8", MX), ("nvfp4", NV)):
        out = tmp_path / f"{name}.json"
        code, _, err = tune(capsys, "--model.preset=llama3-8b", "--cluster.gpu=b200",
                            "--cluster.gpus=8", "--train.global_batch=64",
                            "--train.seq_len=4096", "--precision.dtype=bf16", "--parallel.tp=1",
                            "--parallel.pp=1", "--top", "1", "--json", str(out), *knobs)
        assert code == 0, err
        times[name] = json.loads(out.read_text())["candidates"][0]["step_time_s"]
    assert times["bf16"] > times["mxfp8"] > times["nvfp4"], times
    profiles = builtin_profiles()
    cfg = load_config(overrides=["--model.preset=llama3-8b", "--precision.dtype=bf16", *NV])
    assert problem_of(cfg, Cluster(profiles["h100-sxm"], 8)).gemm_dtype == "fp8"
    assert problem_of(cfg, Cluster(profiles["gb200"], 72)).gemm_dtype == "fp4"
    assert profiles["gb200"].gpus_per_node == 72
