"""muP (``model.mup``): off changes nothing, at the base width it is the standard
parameterisation exactly, and the coordinate check of Tensor Programs V holds (measured here):
with muP the change of the logits and of a hidden layer's output after a few Adam steps stays
flat across widths, while the standard parameterisation's grows with width."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize, lr_multipliers
from meshtron.models.transformer import Transformer
from meshtron.optim.adamw import build_adamw
from meshtron.optim.data_parallel import ShardedOptimizer, build_optimizer
from meshtron.parallel.mesh import ParallelMesh
from meshtron.plan import plan_run
from meshtron.rank import Rank, build_rank, rank_with
from meshtron.training.step import train_step
from tests.distributed import run_distributed
from tests.parity import assert_layouts_match, run_layouts

BATCH, SEQ, VOCAB = 4, 32, 512
WIDTHS = (64, 128, 256, 512)


def make_cfg(width: int, *extra: str):
    return load_config(overrides=[
        f"--model.vocab_size={VOCAB}", f"--model.hidden_size={width}", "--model.num_heads=4",
        f"--model.ffn_hidden_size={3 * width}", "--model.num_layers=2",
        f"--train.seq_len={SEQ}", f"--train.global_batch={BATCH}",
        f"--train.micro_batch={BATCH}", "--train.seed=0", "--train.weight_decay=0.1", *extra])


def build(cfg, seed: int = 0) -> Transformer:
    model = Transformer(cfg.model)
    initialize(model, seed=seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    return model.train()


def windows(steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def train(rank: Rank, steps: int, lr: float | None = None) -> list[float]:
    return [train_step(rank, window, lr or rank.plan.config.train.lr).loss
            for window in windows(steps)]


def run(cfg, steps: int) -> tuple[Transformer, list[float]]:
    rank = build_rank(plan_run(cfg, 1), ParallelMesh.single())
    return rank.model, train(rank, steps)


def test_mup_false_is_the_default_bit_for_bit():
    default, explicit = make_cfg(64), make_cfg(64, "--model.mup=false",
                                               "--model.mup_base_width=32")
    a, b = build(default), build(explicit)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    _, losses_a = run(default, 1)
    _, losses_b = run(explicit, 1)
    assert losses_a == losses_b


def test_at_the_base_width_mup_is_the_standard_parameterisation_exactly():
    """The attention scale sqrt(d_base)/d equals 1/sqrt(d) at the base width, so every
    number agrees: initial weights, losses of a few steps, the trained weights."""
    standard, mup = make_cfg(64), make_cfg(64, "--model.mup=true", "--model.mup_base_width=64")
    a, losses_a = run(standard, 3)
    b, losses_b = run(mup, 3)
    assert losses_a == losses_b
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_init_and_learning_rates_scale_as_mup_says():
    cfg = make_cfg(256, "--model.mup=true", "--model.mup_base_width=64")  # m = 4
    base = build(make_cfg(256))
    model = build(cfg)
    mults = lr_multipliers(model)
    for (name, p), q in zip(model.named_parameters(), base.parameters()):
        hidden = p.dim() >= 2 and name not in ("embed.weight", "output.weight")
        assert mults.get(id(p), 1.0) == (0.25 if hidden else 1.0), name
        # same generator per name: hidden matrices are the standard draw / sqrt(m)
        assert torch.allclose(p, q / 2 if hidden else q, rtol=1e-6, atol=0), name
    assert model.logit_scale == 0.25 and model.layers["0"].attn.query_scale == 0.5
    tied = build(make_cfg(256, "--model.mup=true", "--model.mup_base_width=64",
                          "--model.tie_embeddings=true"))
    assert tied.logit_scale == 0.25  # the readout multiplier only: the embedding keeps its lr
    assert id(tied.embed.weight) not in lr_multipliers(tied)


def test_the_multiplier_reaches_zero0_groups_and_zero1_buckets():
    cfg = make_cfg(128, "--model.mup=true", "--model.mup_base_width=64")  # m = 2
    model = build(cfg)
    mults = lr_multipliers(model)
    zero0 = build_optimizer(model, ParallelMesh.single(), cfg.train, zero=0, bucket_mb=25.0)
    groups = zero0.adamw.param_groups
    assert [(g.get("lr_mult", 1.0), g["weight_decay"]) for g in groups] == [
        (1.0, 0.1), (0.5, 0.2), (1.0, 0.0)]  # lr x wd per step stays the base's
    assert {id(p) for p in groups[1]["params"]} == set(mults)
    # the flat-bucket AdamW of ZeRO 1-3, on one rank (its chunk is the whole bucket)
    twin = build(cfg)
    zero1 = ShardedOptimizer(twin, ParallelMesh.single(), cfg.train, zero_stage=1, bucket_mb=0.05)
    twin_mults = lr_multipliers(twin)
    buckets = zero1.reducer.buckets
    assert {b.lr_mult for b in buckets} == {0.5, 1.0}
    for bucket in buckets:  # never mixed
        assert {twin_mults.get(id(p), 1.0) for p in bucket.params} == {bucket.lr_mult}
    plan = plan_run(cfg, 1)  # twin models, one optimizer kind each
    losses0 = train(rank_with(plan, model, zero0), 3)
    losses1 = train(rank_with(plan, twin, zero1), 3)
    assert losses1 == pytest.approx(losses0, rel=1e-6)
    with torch.no_grad():  # the same update up to rounding (Adam magnifies last bits)
        for (name, x), y in zip(model.named_parameters(), twin.parameters()):
            assert float((x - y).norm() / x.norm()) < 1e-5, name


def test_the_per_parameter_table_agrees_with_the_mup_package():
    """The ``mup`` package (Microsoft's reference implementation) classifies each parameter
    by its shapes at two widths (``set_base_shapes``) and scales it in ``MuAdamW`` and its
    init functions: the same model at m = 2 must get the same matrix-like set, init scale,
    learning rate and weight decay from meshtron, for a dense and a MoE model."""
    import mup  # make setup installs it without its plotting dependencies
    for extra in ((), ("--model.moe.num_experts=4", "--model.moe.top_k=2")):
        ours_cfg = make_cfg(128, "--model.mup=true", "--model.mup_base_width=64", *extra)
        ours, standard = build(ours_cfg), build(make_cfg(128, *extra))
        theirs = mup.set_base_shapes(build(make_cfg(128, *extra)), build(make_cfg(64, *extra)))
        adamw = mup.MuAdamW(theirs.parameters(), lr=ours_cfg.train.lr,
                            weight_decay=ours_cfg.train.weight_decay)
        their_group = {id(p): g for g in adamw.param_groups for p in g["params"]}
        our_group = {id(p): g for g in build_adamw(ours, ours_cfg.train).param_groups
                     for p in g["params"]}
        for (name, p), q, r in zip(ours.named_parameters(), standard.parameters(),
                                   theirs.parameters()):
            matrix_like = r.infshape.ninf() == 2
            assert (id(p) in lr_multipliers(ours)) == matrix_like, name
            scale = r.infshape.width_mult() ** -0.5 if matrix_like else 1.0  # constant_std_init_
            assert torch.allclose(p, q * scale, rtol=1e-6, atol=0), name
            if not p.requires_grad:  # the router's balancing bias: no optimizer
                continue
            mine, yours = our_group[id(p)], their_group[id(r)]
            assert mine["lr"] == pytest.approx(yours["lr"], rel=1e-12), name
            if p.dim() >= 2:  # mup decays every tensor; meshtron (as Megatron) only matrices
                assert mine["weight_decay"] == pytest.approx(yours["weight_decay"]), name
        assert ours.logit_scale == pytest.approx(1 / theirs.output.weight.infshape.width_mult())


def coordinate_change(width: int, mup: bool, steps: int = 3, lr: float = 1e-2
                      ) -> tuple[float, float]:
    """Mean |change| of the logits and of block 0's output on a fixed batch after ``steps``
    Adam steps at ``lr`` (muP's base width 64)."""
    cfg = make_cfg(width, f"--model.mup={str(mup).lower()}", "--model.mup_base_width=64",
                   "--train.weight_decay=0.0", "--train.grad_clip=0")
    rank = build_rank(plan_run(cfg, 1), ParallelMesh.single())
    model = rank.model
    probe = windows(1, seed=1)[0][:, :-1]
    seen: dict[str, torch.Tensor] = {}
    model.layers["0"].register_forward_hook(lambda m, i, out: seen.__setitem__("h", out))

    def coordinates() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(probe)[..., :VOCAB]
        return logits, seen["h"]

    logits0, hidden0 = coordinates()
    train(rank, steps, lr)
    logits1, hidden1 = coordinates()
    return (float((logits1 - logits0).abs().mean()), float((hidden1 - hidden0).abs().mean()))


def spread(values: list[float]) -> float:
    return max(values) / min(values)


def test_coordinate_check():
    """The figures print with ``pytest -s`` (and on a failure)."""
    figures = {mup: [coordinate_change(w, mup) for w in WIDTHS] for mup in (True, False)}
    for mup, rows in figures.items():
        print(f"\nmup={mup}: width, mean|d logits|, mean|d block-0 output| after 3 steps")
        for width, (dl, dh) in zip(WIDTHS, rows):
            print(f"  {width:4d}  {dl:.4f}  {dh:.4f}")
    mup_logits = [dl for dl, _ in figures[True]]
    mup_hidden = [dh for _, dh in figures[True]]
    sp_logits = [dl for dl, _ in figures[False]]
    sp_hidden = [dh for _, dh in figures[False]]
    # the logits carry a finite-width term (initial readout x change of its input, ~
    # 1/sqrt(width)) that is largest at width 64: 2.5x there, 2x for the hidden layer
    assert spread(mup_logits) < 2.5 and spread(mup_hidden) < 2
    growth_sp = sp_logits[-1] / sp_logits[0]
    growth_mup = mup_logits[-1] / mup_logits[0]
    assert growth_sp > 2 * growth_mup and growth_sp > 2
    assert sp_hidden[-1] / sp_hidden[0] > 10 * mup_hidden[-1] / mup_hidden[0]


MUP = ["--model.mup=true", "--model.mup_base_width=32"]  # m = 2 on the 64-wide test model
MUP_LAYOUTS = [MUP + ["--parallel.zero=2", "--parallel.bucket_mb=0.02"],
               MUP + ["--parallel.tp=2", "--parallel.sp=true"]]


@pytest.mark.slow
def test_mup_keeps_layout_parity(data_cache, tmp_path):
    """The multipliers under sharded buckets (dp=2, ZeRO-2) and the init and scales under
    tensor parallelism match the one-process muP run (the parity contract)."""
    results = run_distributed(run_layouts, 2, data_cache, str(tmp_path), MUP_LAYOUTS)
    assert_layouts_match(MUP_LAYOUTS, results, data_cache, tmp_path)


@pytest.mark.parametrize("override, needle", [
    ("--model.mup_base_width=0", "model.mup_base_width must be a positive integer, got 0"),
    ("--model.mup_base_width=-64", "model.mup_base_width must be a positive integer"),
    ("--model.attention=mla", "model.mup does not combine with model.attention=mla"),
])
def test_bad_values_are_one_line(override, needle):
    with pytest.raises(MeshtronError) as err:
        load_config(overrides=["--model.mup=true", override])
    message = str(err.value)
    assert needle in message and "\n" not in message
