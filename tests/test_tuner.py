"""`meshtron tune`: the cost model's parts against exact quantities, never wall-clock time.

FLOPs against :mod:`meshtron.models.flops`; bytes per rank against the optimizers' own
``memory_bytes()`` and the ZeRO closed forms; the pipeline against the schedule simulator; the
published GPT-3 175B figure on paper. The command itself: tests/test_tune_command.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.costmodel import workload
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.estimate import Estimator, Problem, zb_v_order_costs
from meshtron.costmodel.memory_model import stage_params, state_bytes, with_vocab
from meshtron.costmodel.priced import ActionCosts
from meshtron.costmodel.profiles import load_profile
from meshtron.costmodel.search import Pins, search
from meshtron.models.flops import layer_size, model_size, training_flops_per_token
from meshtron.models.init import initialize
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.optim.data_parallel import build_optimizer
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.pipeline.schedules import build_schedule
from meshtron.precision.policy import Precision
from meshtron.training.live_memory import LiveTensorBytes
from tests.distributed import run_distributed

ROW_KEYS = {"tp", "cp", "pp", "vpp", "schedule", "ep", "dp", "zero", "sp", "micro_batch",
            "recompute", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu",
            "memory_per_gpu_bytes", "fits"}


def model_of(preset: str, *overrides: str, vocab: int = 256):
    """A preset's model config with its vocabulary resolved (presets may leave it unset)."""
    cfg = load_config(overrides=[f"--model.preset={preset}", *overrides]).model
    return with_vocab(cfg, vocab)


def candidate(tp=1, cp=1, pp=1, vpp=1, schedule="1f1b", ep=1, etp=None, dp=1, zero=0, sp=False,
              micro_batch=1, recompute="none") -> Candidate:
    return Candidate(tp, cp, pp, vpp, schedule, ep, etp, dp, zero, sp, micro_batch, recompute)


def tune(capsys, *args: str) -> tuple[int, str, str]:
    """``meshtron tune ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main(["tune", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-deepseek", "gpt2-small",
                                    "llama3-8b", "deepseek-v3", "moe-10t"])
def test_layer_and_head_flops_add_up_to_the_models_training_flops(preset):
    """3 x (the layers' parts + the output heads, one per multi-token-prediction module too)
    is :func:`training_flops_per_token` exactly, but for the MTP modules' merge projection
    (2h -> h per token), which the workload leaves out: the difference is exactly that term."""
    cfg, seq = model_of(preset), 512
    layers = range(cfg.num_layers + cfg.mtp_depth)
    parts = sum(sum(workload.layer_flops_per_token(cfg, i, seq).values()) for i in layers)
    heads = (1 + cfg.mtp_depth) * workload.head_flops_per_token(cfg)
    merge = 3 * cfg.mtp_depth * 2.0 * (2 * cfg.hidden_size) * cfg.hidden_size
    assert 3 * parts + 3 * heads + merge == training_flops_per_token(cfg, seq)
    if preset in ("tiny-deepseek", "deepseek-v3"):
        assert merge > 0


@pytest.mark.parametrize("preset, tp, cp, ep, etp, mb", [
    ("tiny", 1, 1, 1, None, 2), ("tiny", 2, 1, 1, None, 1), ("tiny", 4, 2, 1, None, 3),
    ("tiny-moe", 1, 1, 1, None, 1), ("tiny-moe", 2, 1, 2, None, 2),
    ("tiny-moe", 2, 2, 4, 1, 1), ("tiny-deepseek", 2, 1, 2, None, 1),
    ("llama3-8b", 8, 2, 1, None, 1)])
def test_one_ranks_gemms_times_the_split_are_the_layers_flops(preset, tp, cp, ep, etp, mb):
    """A layer's GEMMs on one rank of a layout, times the ranks that share the work, are the
    per-token FLOPs times the micro-batch's tokens (the router is replicated over tp); the
    attention core is half the Megatron (full-score) count: causal. The head likewise."""
    cfg, seq = model_of(preset), 256
    c = candidate(tp=tp, cp=cp, ep=ep, etp=etp, dp=max(ep, 1), micro_batch=mb)
    tokens = mb * seq  # per sequence-parallel group of cp ranks
    for layer in range(cfg.num_layers + cfg.mtp_depth):
        parts = workload.layer_flops_per_token(cfg, layer, seq)
        work = workload.layer_work(cfg, layer, seq, c, element_size=2)
        router = parts.get("router", 0.0) * tokens / cp
        matmuls = sum(v for k, v in parts.items() if k not in ("attention", "router"))
        assert (work.gemm_flops - router) * tp * cp == pytest.approx(matmuls * tokens,
                                                                     rel=1e-12)
        assert work.attention_flops * tp * cp == pytest.approx(
            parts["attention"] * tokens / 2, rel=1e-12)
    head = workload.head_work(cfg, seq, c, element_size=2)
    assert head.gemm_flops * tp * cp == pytest.approx(
        workload.head_flops_per_token(cfg) * tokens, rel=1e-12)


# ----------------------------------------------------------------------------- memory


def optimizer_accounting(preset: str, dtype: str, zero: int, mesh: ParallelMesh,
                         *extra: str) -> tuple[dict, dict, int]:
    """The real optimizer's ``memory_bytes()`` for a small model of ``preset`` on ``mesh``,
    the memory model's state for the same layout, and the buckets' padding (elements)."""
    layout = mesh.layout
    cfg = load_config(overrides=[
        f"--model.preset={preset}", "--model.vocab_size=500", "--model.num_layers=2",
        f"--precision.dtype={dtype}", f"--parallel.zero={zero}", "--parallel.bucket_mb=0.25",
        *extra])
    # its own assembly: the optimizer's accounting of shapes no plan need accept, no weights drawn
    model = Transformer(cfg.model, mesh)
    precision = Precision(dtype, torch.device("cpu"), reduce_dtype=cfg.precision.reduce_dtype)
    precision.cast_parameters(model)
    optimizer = build_optimizer(model, mesh, cfg.train, zero=zero,
                                bucket_mb=cfg.parallel.bucket_mb,
                                reduce_dtype=precision.reduce_dtype)
    optimizer.init_state()  # as the trainer does: torch's AdamW makes its moments lazily
    m = cfg.model
    c = candidate(tp=layout.tp, ep=layout.ep, etp=layout.etp, dp=layout.dp, zero=zero)
    predicted = state_bytes(stage_params(m, list(range(m.num_layers)), True, True, 1), c,
                            torch.empty((), dtype=precision.param_dtype).element_size(),
                            torch.empty((), dtype=precision.reduce_dtype).element_size())
    buckets = getattr(optimizer.reducer, "buckets", [])
    padding = sum(b.padded - b.numel for b in buckets)
    return optimizer.memory_bytes(), predicted, padding


ONE_RANK = [(preset, dtype, zero) for preset in ("tiny", "tiny-moe", "tiny-deepseek")
            for dtype in ("fp32", "bf16") for zero in (0, 1, 2, 3)]


@pytest.mark.parametrize("preset, dtype, zero",
                         [c for c in ONE_RANK if not (c[1] == "fp32" and c[2] > 0)])
def test_state_bytes_equal_the_optimizers_own_accounting_on_one_rank(preset, dtype, zero):
    """dp=1: nothing to pad, so every key is exact (bf16: whole flat buckets with fp32
    masters; a one-rank ZeRO 1-3 runs as ZeRO 0)."""
    got, predicted, padding = optimizer_accounting(preset, dtype, zero, ParallelMesh.single())
    assert padding == 0
    assert got == predicted


def test_one_rank_fp32_zero_1_to_3_holds_no_master_weights():
    """fp32 parameters are their own masters, and one data-parallel rank runs every stage as
    stage 0 (an earlier state_bytes charged a pinned ZeRO 1-3 for masters that never exist)."""
    for zero in (1, 2, 3):
        got, predicted, _ = optimizer_accounting("tiny", "fp32", zero, ParallelMesh.single())
        assert got["master"] == 0
        assert predicted == got, zero


def two_rank_accounting(rank: int, world_size: int) -> list[tuple]:
    out = []
    for zero in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16"):
            mesh = ParallelMesh(MeshLayout(world_size), rank)
            out.append(("tiny", zero, dtype, *optimizer_accounting("tiny", dtype, zero, mesh)))
    odd = ("--model.arch=gpt2", "--model.hidden_size=63", "--model.num_heads=7",
           "--model.num_kv_heads=7", "--model.ffn_hidden_size=127", "--model.max_seq_len=64")
    for zero in (1, 3):  # odd-sized buckets: each pads to a multiple of dp=2
        mesh = ParallelMesh(MeshLayout(world_size), rank)
        out.append(("odd gpt2", zero, "fp32",
                    *optimizer_accounting("tiny", "fp32", zero, mesh, *odd)))
    for zero in (1, 3):  # experts over ep=2 (their expert-data-parallel group is one rank)
        mesh = ParallelMesh(MeshLayout(world_size, ep=2), rank)
        out.append(("tiny-moe", zero, "bf16",
                    *optimizer_accounting("tiny-moe", "bf16", zero, mesh,
                                          "--parallel.ep=2")))
    return out


@pytest.mark.slow
def test_state_bytes_equal_the_optimizers_accounting_on_two_data_parallel_ranks():
    """dp=2 over gloo, ZeRO 0-3, fp32 and bf16, and experts over ep=2: every key equal up to
    the buckets' padding to a multiple of dp (dp-1 = one element per bucket, a handful of
    buckets), at most 8 bytes per padded element (fp32 gradients or parameters; a 1/dp chunk
    of fp32 master and two moments): a few dozen bytes. The odd-sized model pads; the others
    are exact."""
    rows = [row for rank_rows in run_distributed(two_rank_accounting, 2) for row in rank_rows]
    assert any(padding for *_, padding in rows)  # the bound below is exercised
    for preset, zero, dtype, got, predicted, padding in rows:
        where = (preset, zero, dtype)
        assert 0 <= padding <= 16, where
        assert set(got) == set(predicted), where
        for key in got:
            assert abs(got[key] - predicted[key]) <= 8 * padding, (where, key, got, predicted)


def tensor_parallel_accounting(rank: int, world_size: int) -> list[tuple]:
    mesh = ParallelMesh(MeshLayout(world_size, tp=2), rank)
    return [optimizer_accounting("tiny", dtype, 0, mesh, "--parallel.tp=2")
            for dtype in ("fp32", "bf16")]


# BUG (meshtron/costmodel/memory_model.py, rank_params): every dense parameter is divided by tp,
# but the norm weights (and other replicated parameters) are whole on every tp rank; the
# tiny 2-layer model at tp=2 holds 640 more parameters per rank than predicted (2560 bytes of
# fp32 params, grads; 5120 of moments). Small for large models, but not "exactly" the
# optimizer's accounting as the module promises.
@pytest.mark.slow
def test_state_bytes_equal_the_optimizers_accounting_under_tensor_parallelism():
    for rank_rows in run_distributed(tensor_parallel_accounting, 2):
        for got, predicted, padding in rank_rows:
            assert padding == 0
            assert got == predicted


@pytest.mark.parametrize("zero, per_param", [(1, 2 + 4 + (4 + 8) / 8), (3, (2 + 4 + 4 + 8) / 8)])
def test_llama3_8b_on_8_gpus_state_per_gpu_is_the_zero_closed_form(zero, per_param):
    """bf16 parameters (2), fp32 gradient buckets (4: precision.reduce_dtype's default), fp32
    master (4) and two fp32 moments (8) sharded over dp=8 from ZeRO 1; everything over 8 under
    ZeRO 3. P is the model's whole parameter count."""
    cfg = load_config(overrides=["--model.preset=llama3-8b", "--precision.dtype=bf16",
                                 "--train.seq_len=8192", "--train.global_batch=8"])
    assert cfg.precision.reduce_dtype == "fp32"
    params = model_size(cfg.model).params
    problem = Problem(cfg.model, 8192, 8, load_profile("h100-sxm"), 8, dtype="bf16",
                      reduce_dtype=cfg.precision.reduce_dtype)
    c = candidate(dp=8, zero=zero)
    memory = Estimator(problem).memory(c)
    assert memory.state == pytest.approx(params * per_param, rel=1e-12)
    # the same through the search's path for one pinned layout
    est = search(problem, Pins(tp=1, cp=1, pp=1, zero=zero, micro_batch=1, recompute="full"),
                 cfg).ranked[0]
    assert est.memory.state == pytest.approx(params * per_param, rel=1e-12)
    # the optimizer step reads and writes that state once (memory-bound), and the search's
    # state check reads the same shared figure
    estimator = Estimator(problem)
    profile = load_profile("h100-sxm")
    optimizer = estimator.data_parallel_costs(c, 0)[1]
    assert optimizer == pytest.approx(2 * params * per_param / profile.memory_bandwidth,
                                      rel=1e-12)
    assert estimator.stage_state(c, 0)[1] == pytest.approx(params * per_param, rel=1e-12)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_copying_backend_holds_the_queued_gradients_at_the_end_of_the_backward(zero):
    """A backend that copies each queued reduce-scatter's input (gloo, ``reduce_scatter_copy``
    1) holds the rank's whole gradient buffer once more under ZeRO 1 (the state's gradient
    bytes: every bucket is queued before the first is waited for) and under ZeRO 3 the two
    latest units' full gradients (the reducer keeps no more queued; the largest unit of
    ``small`` is its root: embedding, final norm and output layer); ZeRO 0 all-reduces in
    place. The step's buffers are the larger of that and activations plus transients, and the
    heap's slack scales them, not the state."""
    cfg = load_config(overrides=["--model.preset=small", "--precision.dtype=fp32",
                                 "--train.seq_len=128", "--train.global_batch=2"])
    profile = dataclasses.replace(load_profile("h100-sxm"), reduce_scatter_copy=1.0,
                                  memory_step_slack=0.5)
    problem = Problem(cfg.model, 128, 2, profile, 2, dtype="fp32", reduce_dtype="fp32")
    memory = Estimator(problem).memory(candidate(dp=2, zero=zero, micro_batch=1))
    size = model_size(cfg.model)
    whole = size.params * 4
    root = size.params - sum(layer_size(cfg.model, i)[0] for i in range(cfg.model.num_layers))
    expected = {0: 0, 1: whole, 3: 2 * 4 * root}[zero]
    assert memory.collective_copies == pytest.approx(expected, rel=1e-12)
    if zero == 1:
        assert memory.collective_copies == memory.grads
    buffers = max(memory.activations + memory.transient, memory.collective_copies)
    assert memory.step_buffers == buffers
    assert memory.peak == pytest.approx(memory.state + 1.5 * buffers + memory.reserved)


def measured_step_peak(cfg, recompute: str, batch: int, seq: int) -> int:
    """The high-water mark of every storage one forward + loss + backward of ``batch``
    sequences creates (activations, recomputed layers, gradients in flight, logits), the
    parameters' gradients allocated beforehand as the trainer's buckets are."""
    model = Transformer(cfg, options=ModelOptions(recompute=recompute))
    initialize(model, seed=0, std=0.02, num_layers=cfg.num_layers)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    with LiveTensorBytes() as live:
        model.loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return live.peak


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_activation_memory_at_its_peak_is_the_measured_one(recompute):
    """The cost model's step buffers (saved activations, plus under full recompute the one
    layer whose activations are rebuilt during its backward, plus the logits) against the
    peak of what a real step creates, measured storage by storage. The model leaves out only
    the gradients in flight (about one layer's worth of small tensors): within 15%. Without
    the recomputed layer, full recompute would be priced at a third of what it uses."""
    batch, seq = 2, 16
    cfg = load_config(overrides=["--model.vocab_size=128", "--model.hidden_size=64",
                                 "--model.num_heads=4", "--model.ffn_hidden_size=96",
                                 "--model.num_layers=4"]).model
    problem = Problem(cfg, seq, batch, load_profile("h100-sxm"), 1, dtype="fp32",
                      reduce_dtype="fp32")
    memory = Estimator(problem).memory(candidate(micro_batch=batch, recompute=recompute))
    predicted = memory.activations + memory.transient
    measured = measured_step_peak(cfg, recompute, batch, seq)
    assert abs(predicted - measured) <= 0.15 * measured, (recompute, predicted, measured)


# ----------------------------------------------------------------------------- pipeline


PIPELINES = [("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2), ("interleaved", 4, 4),
             ("zb-h1", 4, 1), ("zb-h1", 8, 1), ("gpipe", 4, 1), ("zb-v", 4, 2)]


def pipeline_problem(preset: str, pp: int, microbatches: int) -> Problem:
    cfg = model_of(preset, vocab=50000)
    return Problem(cfg, 2048, 2 * microbatches, load_profile("a100-80gb"), 2 * pp,
                   dtype="bf16")


@pytest.mark.parametrize("schedule, pp, vpp", PIPELINES)
@pytest.mark.parametrize("microbatches", [8, 24, 200])
def test_equal_stage_costs_give_the_simulators_makespan_and_the_closed_form(
        schedule, pp, vpp, microbatches):
    """With every chunk at F=1, B=1, W=1 (a whole backward: B+W=2) the estimator's pipeline is
    the simulator's makespan at the default unit costs, and that is the busy time over one
    minus the schedule's theoretical bubble, as the closed form says."""
    c = candidate(pp=pp, vpp=vpp, schedule=schedule, dp=2)
    estimator = Estimator(pipeline_problem("llama3-8b", pp, microbatches))
    _, shapes, _ = estimator.pipeline(c)
    unit = {chunk: ActionCosts(1.0, 1.0, 1.0, 0.0) for s in shapes for chunk in s.chunks}
    simulated = build_schedule(schedule, pp, vpp, microbatches)
    makespan = max(row[-1][1] for row in simulated.timeline() if row)
    assert estimator.pipeline_seconds(c, unit, microbatches) == pytest.approx(makespan,
                                                                             rel=1e-12)
    busy = 3.0 * vpp * microbatches
    closed = estimator.closed_form_seconds(c, 3.0 * vpp, microbatches)
    assert closed == pytest.approx(busy / (1 - simulated.theoretical_bubble()), rel=1e-12)
    if schedule != "gpipe":  # gpipe's closed form is 1f1b's; its simulation is too
        assert closed == pytest.approx(makespan, rel=1e-12)


@pytest.mark.parametrize("preset, schedule, pp, vpp, microbatches", [
    ("llama3-8b", "1f1b", 4, 1, 200), ("llama3-8b", "1f1b", 4, 1, 203),
    ("llama3-8b", "interleaved", 4, 2, 200), ("llama3-8b", "zb-h1", 4, 1, 200),
    ("gpt3-175b", "1f1b", 32, 1, 40), ("gpt3-175b", "interleaved", 8, 3, 40),
    ("gpt3-175b", "zb-h1", 16, 1, 30), ("tiny-deepseek", "1f1b", 4, 1, 101),
    ("tiny-deepseek", "interleaved", 2, 2, 100), ("llama3-8b", "zb-v", 4, 2, 200)])
def test_extrapolated_pipeline_equals_a_direct_simulation(preset, schedule, pp, vpp,
                                                          microbatches):
    """Past 24 micro-batches the estimator simulates two counts and extends the line; with the
    real (unequal: the last stage holds the head, MTP modules) per-stage costs that equals a
    direct simulation at the full count (zb-v: within 1%)."""
    c = candidate(pp=pp, vpp=vpp, schedule=schedule, dp=2)
    estimator = Estimator(pipeline_problem(preset, pp, microbatches))
    _, shapes, _ = estimator.pipeline(c)
    costs = estimator.chunk_costs(c)
    assert len(set(costs.values())) > 1  # the stages really differ

    def price(stage, action):
        a = costs[shapes[stage].chunks[action.chunk]]
        if action.kind == "F":
            return a.forward
        if action.kind == "W":
            return a.weight
        return a.backward if schedule in ("zb-h1", "zb-v") else a.backward + a.weight

    order = zb_v_order_costs(c, shapes, costs) if schedule == "zb-v" else None
    rows = build_schedule(schedule, pp, vpp, microbatches, costs=order).timeline(
        action_cost=price)
    direct = max(row[-1][1] for row in rows if row)
    # zb-v's list-scheduled order is not periodic: past the simulated counts it extends at
    # the busiest stage's pace (within 0.7% of direct simulations from 30 to 400 here)
    rel = 0.01 if schedule == "zb-v" else 1e-9
    assert estimator.pipeline_seconds(c, costs, microbatches) == pytest.approx(direct, rel=rel)


@pytest.mark.parametrize("preset, schedule, pp, vpp, microbatches, zero, recompute", [
    ("llama3-8b", "1f1b", 4, 1, 12, 1, "none"), ("llama3-8b", "gpipe", 4, 1, 8, 0, "full"),
    ("gpt3-175b", "interleaved", 8, 3, 40, 3, "selective"),
    ("gpt3-175b", "zb-h1", 16, 1, 30, 2, "none"), ("tiny-deepseek", "1f1b", 4, 1, 101, 1,
                                                   "full"),
    ("tiny-deepseek", "interleaved", 2, 2, 100, 0, "none"),
    ("llama3-8b", "zb-v", 4, 2, 12, 1, "none")])
def test_the_peak_over_stages_is_the_highest_stage_priced_alone(preset, schedule, pp, vpp,
                                                                microbatches, zero, recompute):
    """The search prices only the stages that can hold the peak: the result is the first
    stage's estimate among those with the highest peak, over every stage priced alone."""
    c = candidate(pp=pp, vpp=vpp, schedule=schedule, dp=2, zero=zero, recompute=recompute)
    estimator = Estimator(pipeline_problem(preset, pp, microbatches))
    each = [estimator.memory(c, stage=s) for s in range(pp)]
    highest = max(m.peak for m in each)
    assert estimator.memory(c) == next(m for m in each if m.peak == highest)


def test_a_pipeline_stage_counts_its_receives_posted_ahead(monkeypatch):
    """A stage holds ``build_schedule``'s ``receives_ahead`` hidden-state messages (micro-batch x
    seq x hidden x 2 bytes in bf16) per stream it receives on, beyond the consumed one:
    1f1b at pp=4 posts 1 ahead, on one stream at the ends and two in the middle; interleaved
    at pp=4 posts 2, on two streams everywhere. They are part of the stage's transient."""
    problem = pipeline_problem("llama3-8b", 4, 8)
    estimator = Estimator(problem)
    message = 1 * 2048 * problem.model.hidden_size * 2
    c = candidate(pp=4, schedule="1f1b")
    assert build_schedule("1f1b", 4, 1, 8).receives_ahead == 1
    assert [estimator.posted_receives(c, s) for s in range(4)] == \
        [message, 2 * message, 2 * message, message]
    interleaved = candidate(pp=4, vpp=2, schedule="interleaved")
    assert build_schedule("interleaved", 4, 2, 8).receives_ahead == 2
    assert [estimator.posted_receives(interleaved, s) for s in range(4)] == [4 * message] * 4
    with_posts = estimator.memory(c, stage=1)
    bare = Estimator(problem)  # (an estimator keeps each stage's receives once priced)
    monkeypatch.setattr(bare, "posted_receives", lambda c, stage: 0.0)
    assert with_posts.transient - bare.memory(c, stage=1).transient == 2 * message
    # a deep interleaved pipeline: the need the cost model finds (on the schedule it keeps for
    # the in-flight peak) is what build_schedule posts for the step's own count
    deep = Estimator(pipeline_problem("llama3-8b", 16, 128))
    c = candidate(pp=16, vpp=2, schedule="interleaved")
    ahead = build_schedule("interleaved", 16, 2, 128).receives_ahead
    assert ahead > 2 and deep.posted_receives(c, 0) == ahead * 2 * message


# ----------------------------------------------------------------------------- on paper


def gpt3_problem():
    cfg = load_config(overrides=["--model.preset=gpt3-175b", "--train.seq_len=2048",
                                 "--train.global_batch=1536", "--precision.dtype=bf16"])
    return cfg, Problem(cfg.model, 2048, 1536, load_profile("a100-80gb"), 1024, dtype="bf16")


PUBLISHED = candidate(tp=8, pp=16, dp=8, zero=0, sp=False, micro_batch=1, recompute="full")
"""Megatron-LM's README: GPT-3 175B on 1024 A100s, tp 8, pp 16 (its 138 TFLOP/s per GPU
counts recomputation's extra forward; its step of about 32 s is 103 TFLOP/s of model FLOPs)."""


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("interleaved", 2)])
def test_gpt3_175b_published_layout_reports_model_flops(schedule, vpp):
    """How close the prediction is to the measurement is test_published_runs' table (the 2021
    software pinned); here: it fits, and its TFLOP/s are model FLOPs over the step, never
    counting the recomputed forward."""
    _, problem = gpt3_problem()
    e = Estimator(problem).estimate(dataclasses.replace(PUBLISHED, schedule=schedule, vpp=vpp))
    assert e.fits
    assert e.tflops_per_gpu == pytest.approx(
        training_flops_per_token(problem.model, 2048) * 1536 * 2048 / e.step_time_s / 1024
        / 1e12, rel=1e-12)


def test_gpt3_175b_search_pinned_near_the_published_layout_is_at_least_as_fast():
    """A quick search that still holds the published layout (tp 8, pp 16 pinned), simulating
    only the closed-form pass's best 4 (each simulated candidate's plan check builds its
    192-micro-batch schedule: about 0.2 s apiece)."""
    cfg, problem = gpt3_problem()
    result = search(problem, Pins(tp=8, pp=16), cfg, simulate=4)
    published = Estimator(problem).estimate(PUBLISHED)
    best = result.ranked[0]
    assert best.fits and (best.candidate.tp, best.candidate.pp) == (8, 16)
    assert best.step_time_s <= published.step_time_s


def test_the_search_prices_the_zb_v_twins_of_its_simulated_shortlist():
    """zb-v is left out of the closed-form pass (its closed form is optimistic where chunks
    differ) and priced instead as the zb-v twins of the simulated shortlist's pipelines. For
    GPT-3 175B at tp 4, pp 16 a twin simulates faster than every other schedule and leads;
    with the schedule pinned there are no twins."""
    cfg, problem = gpt3_problem()
    result = search(problem, Pins(tp=4, pp=16), cfg, simulate=4)
    best = result.ranked[0]
    assert best.fits and (best.candidate.schedule, best.candidate.vpp) == ("zb-v", 2)
    others = [e for e in result.ranked if e.fits and e.candidate.schedule != "zb-v"]
    assert others and best.step_time_s < min(e.step_time_s for e in others)
    assert any(best.candidate == dataclasses.replace(e.candidate, schedule="zb-v", vpp=2,
                                                     recompute=best.candidate.recompute)
               for e in others)  # the twin of a simulated layout
    pinned = search(problem, Pins(tp=4, pp=16, schedule="zb-h1"), cfg, simulate=4)
    assert {e.candidate.schedule for e in pinned.ranked} == {"zb-h1"}


@pytest.mark.slow
def test_gpt3_175b_unpinned_search_beats_the_published_layout():
    cfg, problem = gpt3_problem()
    result = search(problem, Pins(), cfg)
    published = Estimator(problem).estimate(PUBLISHED)
    best = result.ranked[0]
    assert best.fits
    assert best.step_time_s <= published.step_time_s
    fitting = [e for e in result.ranked if e.fits]
    assert [e.step_time_s for e in fitting] == sorted(e.step_time_s for e in fitting)
