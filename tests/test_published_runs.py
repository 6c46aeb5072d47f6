"""The cost model against published cluster runs (meshtron/costmodel/published_runs.yaml):
the file's validation, the FLOP conventions its figures are read through, the table of
docs/tuning.md recomputed with its error bounds, and the band `meshtron tune` prints."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from meshtron.costmodel import against_published as ap
from meshtron.costmodel.published import RUNS_FILE, load_published_runs, narayanan_flops
from meshtron.errors import MeshtronError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"


def first_run() -> dict:
    return yaml.safe_load(RUNS_FILE.read_text())["runs"][0]


def write_runs(tmp_path: Path, *runs: dict) -> Path:
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"runs": list(runs)}))
    return path


@pytest.mark.parametrize("change, words", [
    ({"colour": 1}, ("unknown field 'colour'",)),
    ({"gpus": 0}, ("'gpus'", ">= 1", "0")),
    ({"gpus": -8}, ("'gpus'", "-8")),
    ({"hardware": "v900"}, ("unknown hardware 'v900'", "a100-80gb")),
    ({"measured": {"step_time_s": 32, "tokens_per_s_per_gpu": 5}}, ("exactly one of",)),
    ({"measured": {"step_time_s": -1}}, ("'step_time_s'", "positive")),
    ({"layout": {"tp": 8, "cp": 1, "pp": 16, "vpp": 1, "schedule": "2f2b", "ep": 1, "zero": 0,
                 "sp": False}}, ("'schedule'", "2f2b")),
    ({"layout": {"tp": 3, "cp": 1, "pp": 16, "vpp": 1, "schedule": "1f1b", "ep": 1, "zero": 0,
                 "sp": False}}, ("tp x cp x pp = 48", "1024")),
    ({"source": {"url": "ftp://x", "where": "t"}}, ("'source'", "https://")),
    ({"model": {"preset": "gpt9"}}, ("'model'", "gpt9")),
    ({"recompute": "some"}, ("'recompute'", "some")),
    ({"precision": {"dtype": "fp8"}}, ("'dtype'", "bf16")),
])
def test_a_wrong_field_is_one_line_naming_it(tmp_path, change, words):
    bad = {**first_run(), **change}
    with pytest.raises(MeshtronError) as err:
        load_published_runs(write_runs(tmp_path, bad))
    message = str(err.value)
    assert "\n" not in message and "megatron-readme-gpt3-175b" in message
    assert all(w in message for w in words), message


def test_missing_fields_and_duplicate_names_are_refused(tmp_path):
    run = first_run()
    del run["measured"]
    with pytest.raises(MeshtronError, match="missing field 'measured'"):
        load_published_runs(write_runs(tmp_path, run))
    with pytest.raises(MeshtronError, match="'megatron-readme-gpt3-175b' is used twice"):
        load_published_runs(write_runs(tmp_path, first_run(), first_run()))
    (tmp_path / "e.yaml").write_text("runs: [\n")
    with pytest.raises(MeshtronError, match="not valid YAML"):
        load_published_runs(tmp_path / "e.yaml")


def test_the_file_spans_the_classes_the_issue_asks_for():
    runs = load_published_runs()
    assert len(runs) >= 12
    assert {r.generation for r in runs} >= {"a100", "h100"}
    assert {r.moe for r in runs} == {False, True}
    assert min(r.gpus for r in runs) <= 8 and max(r.gpus for r in runs) >= 16384
    assert all(r.url.startswith("https://") and r.where for r in runs)


def test_torchtitan_runs_are_pinned_as_its_code_ran_them():
    """TorchTitan's Grand Teton H100s (96 GB HBM2e at 2.4 TB/s, 500 W) are their own profile,
    whose peak no data sheet gives (so no run on it counts as a data sheet's); its pipelines
    split the local batch into as many micro-batches as stages (config_manager.py's default
    at the benchmarked commit) and reduce each stage's gradients after its last backward."""
    from meshtron.costmodel.profiles import load_profile

    hbm2e = load_profile("h100-hbm2e")
    assert (hbm2e.memory_bytes, hbm2e.memory_bandwidth) == (96e9, 2.4e12)
    assert hbm2e.peak("bf16") == load_profile("h100-sxm").peak("bf16")  # the upper bound
    titan = [r for r in load_published_runs() if r.name.startswith("torchtitan")]
    assert len(titan) == 7 and all(r.hardware == "h100-hbm2e" and not r.data_sheet
                                   for r in titan)
    for r in titan:
        c = r.candidate
        if c.pp > 1:
            assert r.problem.global_batch // (c.dp * c.micro_batch) == c.pp
            assert not r.software.grad_reduce_overlap
        if r.candidate.recompute == "selective":
            assert r.software.selective == "ops"


def test_megatron_readme_138_tflops_counts_the_recomputed_forward():
    """The README's GPT-3 175B step (1536 x 2048 tokens in about 32 s on 1024 A100s) is 138
    TFLOP/s per GPU only with full recomputation's extra forward counted (Narayanan et al.'s
    96·B·s·l·h²·(...)); in model FLOPs, which the cost model predicts, it is 103."""
    run = next(r for r in load_published_runs() if r.name == "megatron-readme-gpt3-175b")
    step = run.problem.global_batch * run.problem.seq_len / run.measured_tokens_per_s_per_gpu() \
        / run.gpus
    assert step == pytest.approx(32.0, rel=1e-12)
    hardware = narayanan_flops(run.model, 2048, 1536) / step / 1024 / 1e12
    model = run.problem.flops_per_step / step / 1024 / 1e12
    assert hardware == pytest.approx(137.7, abs=0.1) and model == pytest.approx(103.3, abs=0.1)


@pytest.mark.slow
def test_the_table_of_docs_tuning_is_recomputed_within_its_bounds():
    """Every published run priced with its recipe pinned (about 10 s: 29 estimates, the
    1T run's 64-stage pipeline simulated); the docs' table is this one, the errors within the
    recorded bounds (all runs; the runs on data-sheet GPUs), and the band and best-MFU
    figures tune prints are these runs'."""
    comparisons = ap.published_comparisons()
    mae, worst = ap.summary(comparisons)
    assert mae <= 0.125 and worst <= 0.348, (mae, worst)
    mae, worst = ap.summary(tuple(c for c in comparisons if c.run.data_sheet))
    assert mae <= 0.077 and worst <= 0.163, (mae, worst)
    docs = DOCS.read_text()
    for line in ap.table_lines(comparisons):
        assert line.strip() in docs, f"docs/tuning.md lacks: {line}"
    low, high = ap.band(comparisons)
    assert (low, high) == pytest.approx(ap.STORED_BAND, abs=1e-3)
    assert len(comparisons) == ap.STORED_RUNS
    for (generation, moe), (mfu, name) in ap.STORED_BEST_MFU.items():
        profile = {"a100": "a100-80gb", "h100": "h100-sxm"}[generation]
        best = ap.best_published_mfu(profile, moe, comparisons)
        assert best is not None and best[1] == name and best[0] == pytest.approx(mfu, abs=1e-3)


def test_a_plan_above_every_published_mfu_of_its_class_says_so():
    lines, entry = ap.plan_confidence(192.2, 0.616, "a100-80gb", False, gpu=True)
    low, high = ap.STORED_BAND
    assert entry["tflops_per_gpu_band"] == pytest.approx([192.2 * low, 192.2 * high])
    assert entry["above_published"] is True
    assert re.search(r"above every published a100 dense run \(best 39\.2%", lines[1])
    lines, entry = ap.plan_confidence(100.0, 0.32, "a100-40gb", False, gpu=True)
    assert entry["above_published"] is False and len(lines) == 1
    # no published MoE run on A100: no claim either way; none on a CPU profile
    assert "above_published" not in ap.plan_confidence(100.0, 0.9, "a100-80gb", True, True)[1]
    assert ap.plan_confidence(1.0, 0.9, "cpu", False, gpu=False) == ([], {})
    # FP8 plans' MFU is over the bf16 peak: no comparison with bf16 runs
    assert "above_published" not in ap.plan_confidence(900.0, 0.9, "h100-sxm", False, True,
                                                       fp8=True)[1]


# ----------------------------------------------------------------- the physics the runs pinned


def test_a_group_with_several_ranks_per_node_leaves_through_as_many_cards():
    """A ring over a group with r ranks in each node crosses a node boundary once per r hops
    and r network cards carry it out: each rank moves its buffer at r x one card's
    bandwidth, up to NVLink's (dp over tp=2 on 8-GPU nodes: 4 ranks per node)."""
    from meshtron.costmodel import comms
    from meshtron.costmodel.profiles import load_profile

    profile = load_profile("h100-sxm")
    group = comms.priced_group(48, 2, 8)
    assert group.crosses_nodes and group.per_node == 4
    seconds = comms.collective_seconds(profile, "reduce_scatter", group, 1e9)
    assert seconds == pytest.approx(47 * profile.inter_node.latency
                                    + 47 / 48 * 1e9 / (4 * profile.inter_node.bandwidth))
    assert comms.priced_group(48, 8, 8).per_node == 1  # one rank per node: one card
    wide = comms.PricedGroup(64, True, 64)  # never faster than the node's own link
    assert comms.collective_seconds(profile, "all_gather", wide, 1e9) == pytest.approx(
        63 * profile.inter_node.latency + 63 / 64 * 1e9 / profile.intra_node.bandwidth)


def estimator_for(name: str, **software):
    from meshtron.costmodel.estimate import Estimator
    from meshtron.costmodel.priced import Software

    run = next(r for r in load_published_runs() if r.name == name)
    return run, Estimator(run.problem, Software(**software), run.pp_layers)


def test_unfused_attention_is_two_full_products_and_six_passes_over_the_scores():
    from meshtron.costmodel.estimate import UNFUSED_SCORE_PASSES
    from meshtron.costmodel.workload import layer_work

    run, fused = estimator_for("megatron-readme-gpt3-175b")
    _, unfused = estimator_for("megatron-readme-gpt3-175b", fused_attention=False)
    p, c = run.problem.profile, run.candidate
    work = layer_work(run.model, 0, 2048, c, 2)
    assert work.score_elements == 96 / 8 * 2048 * 2048  # heads of a tp rank x s x s
    core = unfused._work_seconds(work, 1.0)[1]
    products = 2 * work.attention_flops / (p.peak("fp16") * p.gemm_fraction(
        work.score_gemm_flops))
    memory = UNFUSED_SCORE_PASSES * work.score_elements * 2 / p.memory_bandwidth
    assert core == pytest.approx(products + memory, rel=1e-12)
    assert core > 2 * fused._work_seconds(work, 1.0)[1]


def test_fp8_products_pay_for_casting_their_inputs():
    from meshtron.costmodel.workload import layer_work

    run = next(r for r in load_published_runs() if r.name == "megatron-bridge-llama3-8b-8gpu-fp8")
    c, h = run.candidate, 4096
    plain = layer_work(run.model, 0, 8192, c, 2)
    cast = layer_work(run.model, 0, 8192, c, 2, fp8=True)
    inputs = 8192 * (2 * h + h + 14336)  # q/kv and gate_up read h, o reads h, down the ffn
    assert cast.elementwise_bytes - plain.elementwise_bytes == pytest.approx(inputs * 5)


def test_an_overlapped_parameter_gather_hides_behind_the_next_forward():
    run, after = estimator_for("megatron-h100-32b-384gpu")
    _, overlapped = estimator_for("megatron-h100-32b-384gpu", param_gather_overlap=True)
    c = run.candidate
    reduce, gather, _ = after.data_parallel_costs(c, 0)[0][0]
    exposed = after.data_parallel_seconds(c, 0, 0.1, 4, first_forward=0.1)[0]
    hidden = overlapped.data_parallel_seconds(c, 0, 0.1, 4, first_forward=0.1)[0]
    assert exposed - hidden == pytest.approx(min(gather, 0.1), rel=1e-12)
    assert exposed == pytest.approx(reduce - 0.1 + gather, rel=1e-12)
    _, serial = estimator_for("megatron-h100-32b-384gpu", grad_reduce_overlap=False)
    assert serial.data_parallel_seconds(c, 0, 0.1, 4, 0.1)[0] == pytest.approx(reduce + gather)


def test_megatron_runs_without_a_pipeline_hide_the_reduction_behind_one_micro_batch():
    """Megatron's H100 table gives 4 x pp sequences per data-parallel rank: one micro-batch of
    4 without a pipeline (NVIDIA's pp1 GPT recipes' micro_batch_size 4), 4 x pp of 1 with one.
    The 32B run (tp 8: one rank per node in its data-parallel group) reduce-scatters 15 GB of
    fp32 gradients through one card, 0.30 s: hidden behind the backward of its one
    micro-batch of 4, exposed behind the last of 4 micro-batches of 1."""
    for r in (r for r in load_published_runs() if r.name.startswith("megatron-h100")):
        c = r.candidate
        assert r.problem.global_batch // c.dp == 4 * c.pp
        assert c.microbatches(r.problem.global_batch) == (1 if c.pp == 1 else 4 * c.pp)
    run, est = estimator_for("megatron-h100-32b-384gpu", param_gather_overlap=True)
    c = run.candidate
    (reduce, gather, _), _ = est.data_parallel_costs(c, 0)[0]
    assert reduce == pytest.approx(0.302, abs=1e-3) and gather == pytest.approx(0.151, abs=1e-3)
    assert est.step_parts(c, simulate=False)[3][0] == 0.0
    split = dataclasses.replace(c, micro_batch=1)
    assert est.step_parts(split, simulate=False)[3][0] > 0.2


@pytest.mark.parametrize("change, words", [
    ({"software": {"fused_attention": "yes"}}, ("'software'", "fused_attention")),
    ({"software": {"attention_efficiency": 1.5}}, ("attention_efficiency", "(0, 1]")),
    ({"layout": {"tp": 8, "cp": 1, "pp": 16, "vpp": 1, "schedule": "1f1b", "ep": 1, "zero": 0,
                 "sp": False, "pp_layers": [6, 6]}}, ("'pp_layers'", "16 virtual stages")),
    ({"hardware_changes": {"bf16_tflops": 0}}, ("'bf16_tflops'", "positive")),
])
def test_a_wrong_recipe_field_is_one_line(tmp_path, change, words):
    with pytest.raises(MeshtronError) as err:
        load_published_runs(write_runs(tmp_path, {**first_run(), **change}))
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value


# ----------------------------------------------------------------- selective recompute's styles


def test_torchtitan_op_checkpointing_recomputes_every_second_matmul():
    """TorchTitan's per-op policy saves the attention kernel's and the odd matmuls' outputs:
    of Llama 3 8B's q, k, v, o, gate, up, down it recomputes k (1024 of q/k/v's 4096 + 2 x
    1024 columns), o and up, 37% of the block's product FLOPs, with every memory-bound
    operator, and not the attention core (Megatron's selective recomputes only the core)."""
    from meshtron.costmodel.recompute import recomputed_gemm_shares
    from meshtron.costmodel.workload import layer_work

    run, ops = estimator_for("torchtitan-llama3-8b-8gpu-fsdp", selective="ops")
    _, core = estimator_for("torchtitan-llama3-8b-8gpu-fsdp")
    shares = recomputed_gemm_shares(run.model, 0)
    assert shares == pytest.approx((1 / 6, 1.0, 1 / 3), rel=1e-12)
    c = run.candidate
    work = layer_work(run.model, 0, 8192, c, 2)
    weights = (4096 * 1024 + 4096 * 4096 + 4096 * 14336) / (4096 * (4096 + 2048 + 4096)
                                                            + 3 * 4096 * 14336)
    assert sum(s * g.flops for s, g in zip(shares, work.gemms)) / work.gemm_flops \
        == pytest.approx(weights, rel=1e-12) and weights == pytest.approx(0.365, abs=1e-3)
    gemms = ops._gemm_seconds(work, 1.0)
    gemm, attention, memory = ops._work_seconds(work, 1.0)
    none = dataclasses.replace(c, recompute="none")
    extra = ops.layer_seconds(0, c)[1] - ops.layer_seconds(0, none)[1]
    assert extra == pytest.approx(memory + sum(s * g for s, g in zip(shares, gemms)), rel=1e-9)
    assert core.layer_seconds(0, c)[1] - core.layer_seconds(0, none)[1] == pytest.approx(
        attention, rel=1e-9)


def test_what_each_selective_style_saves():
    """Per block and micro-batch (no tp): ``ops`` keeps the input, q, v, the attention output
    and its log-sum-exp, the gate product's output and the MLP's output; ``layers`` every
    N-th block as ``full`` and the others as ``none``."""
    from meshtron.costmodel.memory_model import layer_activation_bytes

    run, _ = estimator_for("torchtitan-llama3-8b-8gpu-fsdp")
    c, n = run.candidate, 2 * 8192
    ops = layer_activation_bytes(run.model, 0, c, 8192, 2, "ops")
    assert ops == 2 * (2 * n * 4096 + 2 * n * 4096 + n * 1024 + n * 32 + n * 14336)
    whole, kept = (layer_activation_bytes(run.model, 0, dataclasses.replace(c, recompute=r),
                                          8192, 2) for r in ("full", "none"))
    assert layer_activation_bytes(run.model, 0, c, 8192, 2, "layers", 4) \
        == pytest.approx((whole + 3 * kept) / 4)
    assert whole < ops < kept


def test_layer_level_checkpointing_repeats_one_block_in_n():
    run, layers = estimator_for("torchtitan-llama3-8b-8gpu-fsdp", selective="layers",
                                selective_every=3)
    c = run.candidate
    none = dataclasses.replace(c, recompute="none")
    full = dataclasses.replace(c, recompute="full")
    every = layers.layer_seconds(0, full)[1] - layers.layer_seconds(0, none)[1]
    assert layers.layer_seconds(0, c)[1] - layers.layer_seconds(0, none)[1] == pytest.approx(
        every / 3, rel=1e-9)


@pytest.mark.parametrize("software, words", [
    ({"selective": "some"}, ("'selective'", "core, ops, layers", "some")),
    ({"selective": "layers", "selective_every": 0}, ("'selective_every'", ">= 1")),
])
def test_a_wrong_selective_style_is_one_line(tmp_path, software, words):
    with pytest.raises(MeshtronError) as err:
        load_published_runs(write_runs(tmp_path, {**first_run(), "software": software}))
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value
