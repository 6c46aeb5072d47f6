"""Multi-token prediction: the tokens ahead, the modules' loss against a direct computation,
unchanged inference logits, sizes and FLOPs, bad settings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.models.flops import model_size, training_flops_per_token
from meshtron.models.init import initialize
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.parallel.context.sequence import SequenceSplit, join_sequence
from meshtron.parallel.mesh.groups import CommStats, Group, ParallelMesh
from meshtron.training.metrics import read_metrics

SMALL = ("--model.hidden_size=32", "--model.num_heads=4", "--model.num_kv_heads=2",
         "--model.ffn_hidden_size=48", "--model.num_layers=2", "--model.vocab_size=200",
         "--model.max_seq_len=64")
WEIGHT = 0.25
CP1 = Group("cp", [0], 0, None, CommStats())


def mtp_model(depth: int, *extra: str, aux_weight: float = 0.0) -> Transformer:
    cfg = load_config(overrides=[*SMALL, f"--model.mtp_depth={depth}",
                                 f"--model.mtp_loss_weight={WEIGHT}", *extra]).model
    model = Transformer(cfg, options=ModelOptions(aux_loss_weight=lambda: aux_weight))
    initialize(model, seed=5, std=0.05, num_layers=cfg.num_layers)
    return model.double()


def test_ahead_holds_the_tokens_after_each_position_on_every_cp_rank():
    window = torch.arange(2 * 17).view(2, 17)  # S = 16
    plain = SequenceSplit(CP1, mtp_depth=2)(window)
    assert plain.ahead.shape == (3, 2, 16)
    assert torch.equal(plain.ahead[0], plain.targets)
    for j in range(3):
        for i in range(16):
            expected = window[:, i + 1 + j] if i + 1 + j <= 16 else torch.full((2,), -1)
            assert torch.equal(plain.ahead[j][:, i], expected), (j, i)
    parts = [SequenceSplit(Group("cp", [0, 1], rank, None, CommStats()), mtp_depth=2)(window)
             for rank in range(2)]
    assert torch.equal(join_sequence([p.ahead for p in parts], dim=2), plain.ahead)
    assert SequenceSplit(CP1)(window).ahead is None


def reference_mtp_losses(model: Transformer, window: torch.Tensor) -> list[torch.Tensor]:
    """Each module's token-loss sum computed directly: module k reads the tokens k ahead,
    cut to the positions whose target t_{i+k+1} is inside the window (causality makes the
    cut sequence's states equal to the full one's there)."""
    seq = window.shape[1] - 1
    hidden = model.embed(window[:, :seq])
    for block in model.blocks():
        hidden = block(hidden, model.rotary)
    losses = []
    for k, layer in enumerate(model.mtp_layers(), start=1):
        length = seq - k
        merged = torch.cat([layer.embed_norm(model.embed(window[:, k:k + length])),
                            layer.hidden_norm(hidden[:, :length])], dim=-1)
        hidden = super(type(layer), layer).forward(merged @ layer.merge.weight.T, model.rotary)
        logits = layer.head_norm(hidden) @ model.output.weight.T
        losses.append(F.cross_entropy(logits[..., :200].flatten(0, 1),
                                      window[:, k + 1:].flatten(), reduction="sum"))
    return losses


def test_module_losses_and_their_gradient_equal_a_direct_computation():
    model = mtp_model(2)
    window = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    mb = SequenceSplit(CP1, mtp_depth=2)(window)
    model.aux_loss_weight = lambda: 1.0  # the attached loss's weight: 1 per token-loss unit
    logits = model(mb.tokens, ahead=mb.ahead)
    main = model.loss_sum(logits, mb.targets)
    main.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    sums = model.mtp_losses.sums
    model.zero_grad()
    expected = reference_mtp_losses(model, window)
    torch.testing.assert_close(sums, torch.stack(expected).detach(), rtol=1e-12, atol=0)
    (model.loss_sum(model(mb.tokens), mb.targets) + WEIGHT / 2 * sum(expected)).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-10, atol=1e-14, msg=name)
    assert got["layers.3.merge.weight"].abs().sum() > 0  # the second module trains


def test_inference_logits_are_the_model_without_the_modules():
    with_mtp, without = mtp_model(1), mtp_model(0)
    x = torch.randint(0, 200, (2, 12))
    assert set(without.state_dict()) < set(with_mtp.state_dict())
    with torch.no_grad():
        assert torch.equal(with_mtp.eval()(x), without.eval()(x))
    assert with_mtp.mtp_losses.sums is None  # no tokens ahead given: the modules did not run


def test_sizes_and_flops_count_the_modules():
    with_mtp, without = mtp_model(2), mtp_model(0)
    size, base = model_size(with_mtp.cfg), model_size(without.cfg)
    assert size.params == sum(p.numel() for p in with_mtp.parameters())
    assert size.params - size.mtp_params == base.params
    h, vocab = 32, 256  # padded vocabulary
    block = sum(p.numel() for n, p in with_mtp.named_parameters() if n.startswith("layers.1."))
    assert size.mtp_params == 2 * (block + 3 * h + 2 * h * h)
    assert size.matmul_params - size.mtp_matmul_params == base.matmul_params
    layer_matmul = base.matmul_params - vocab * h  # two layers' weights
    assert size.mtp_matmul_params == 2 * (layer_matmul // 2 + 2 * h * h + vocab * h)
    scores = 4 * (8 + 8)  # heads x (q.k width + value width)
    assert (training_flops_per_token(with_mtp.cfg, 64) - training_flops_per_token(without.cfg, 64)
            == 6 * size.mtp_matmul_params + 6 * 2 * 64 * scores)


def test_deepseek_v3_preset_has_the_published_sizes():
    size = model_size(load_config(overrides=["--model.preset=deepseek-v3"]).model)
    assert round((size.params - size.mtp_params) / 1e9) == 671
    assert round((size.matmul_params - size.mtp_matmul_params) / 1e9) == 37
    # the module's own 11.6B, with the copies of the embedding and head the release stores
    # (2 x 129280 x 7168): the "14B" of DeepSeek-V3's 685B release
    assert round((size.mtp_params + 2 * 129280 * 7168) / 1e9) == 13


@pytest.mark.parametrize(("extra", "message"), [
    (("--model.mtp_depth=-1",), "model.mtp_depth must not be negative, got -1"),
    (("--model.mtp_depth=32", "--train.seq_len=32"),
     "model.mtp_depth=32 predicts tokens up to 33 ahead: train.seq_len=32 leaves none"),
    (("--model.mtp_loss_weight=-0.1",), "model.mtp_loss_weight must not be negative"),
    (("--model.mtp_loss_weight=nan",), "model.mtp_loss_weight must be a finite number"),
])
def test_bad_settings_are_one_line_each(extra, message):
    with pytest.raises(MeshtronError, match=message.replace("(", r"\(")):
        load_config(overrides=[*SMALL, *extra])


def test_a_pipeline_stage_without_the_head_has_no_modules():
    from meshtron.parallel.pipeline.partition import StageLayers

    cfg = mtp_model(1).cfg
    first = Transformer(cfg, ParallelMesh.single(),
                        ModelOptions(stage=StageLayers(((0,),), True, False)))
    last = Transformer(cfg, ParallelMesh.single(),
                       ModelOptions(stage=StageLayers(((1,),), False, True)))
    assert not first.mtp_layers() and len(last.mtp_layers()) == 1
    assert "embed.weight" in dict(last.named_parameters())  # the embedding's copy


@pytest.mark.slow
def test_multi_token_prediction_keeps_parity_under_pp_tp_sp_and_cp(data_cache, tmp_path):
    """The modules on the last of two pipeline stages (with the embedding's copy), under
    sequence-parallel tp (the merge weight replicated), and under cp (each rank's tokens
    ahead cut from the whole window)."""
    from tests.distributed import run_distributed
    from tests.parity import assert_layouts_match, run_layouts

    layouts = [["--parallel.pp=2", "--train.micro_batch=2", "--model.mtp_depth=2"],
               ["--parallel.tp=2", "--parallel.sp=true", "--model.mtp_depth=2"],
               ["--parallel.cp=2", "--model.mtp_depth=1", "--model.tie_embeddings=true"]]
    results = run_distributed(run_layouts, 2, data_cache, str(tmp_path), layouts)
    assert_layouts_match(layouts, results, data_cache, tmp_path)
    # the modules' losses, reduced from the last stage, are the one-process run's
    got, expected = read_metrics(tmp_path / "layout0")[-1], read_metrics(tmp_path / "ref0")[-1]
    assert got["step"] == expected["step"] == 20
    for key in ("mtp/loss", "mtp/loss_1", "mtp/loss_2"):
        assert abs(got[key] - expected[key]) <= 1e-4 * expected[key], key
    assert got["mtp/loss"] == (got["mtp/loss_1"] + got["mtp/loss_2"]) / 2


def test_an_export_to_a_family_without_prediction_layers_is_refused_by_name():
    from meshtron.checkpoint.hf_mapping import hf_format

    with pytest.raises(MeshtronError, match=r"^model.mtp_depth=1: this model exports as Llama, "
                       r"which has no multi-token-prediction layers \(DeepSeek-V3 has"):
        hf_format(mtp_model(1).cfg)
