"""LoRA on routed experts (``model.lora.targets=experts``): each expert its own (A, B) on its
[gate | up] and down products, on the expert's ep rank; parity of ep (and ep x tp) against one
process in fp64 to 1e-9; the merged Hugging Face export gives the adapted model's logits; a
PEFT folder is refused in one line."""

from __future__ import annotations

import pytest
import torch

from meshtron.checkpoint.gguf_convert import convert
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.parallel.tensor.lora import is_adapter
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import FP64_RTOL, Failures, assert_parity, reference_run, run_layouts

MOE = ["--model.moe.num_experts=4", "--model.moe.top_k=2", "--model.moe.expert_ffn_size=64"]
EXPERTS = MOE + ["--model.lora.rank=4", "--model.lora.alpha=8",
                 "--model.lora.targets=experts,attention", "--precision.dtype=fp64",
                 "--train.lr=0.02"]
"""A 4-expert top-2 model, adapters on every expert and on attention; fp64."""

LAYOUTS = [
    EXPERTS + ["--train.steps=8", "--parallel.ep=2", "--parallel.zero=1",
               "--train.micro_batch=2", "--parallel.bucket_mb=0.001"],
    EXPERTS + ["--train.steps=8", "--parallel.ep=2", "--parallel.tp=2", "--parallel.sp=true",
               "--train.micro_batch=2"],
    EXPERTS + ["--train.steps=8", "--parallel.ep=2", "--parallel.tp=2", "--parallel.etp=1",
               "--train.micro_batch=2"],
]
"""On 4 ranks: ep=2 in dp=4 (so the experts' data-parallel group, 2 ranks, is not dp) with
ZeRO-1 sharding the adapters; ep=2 x tp=2 with sequence parallelism (each expert's adapters
split over tp like the expert); whole experts (etp=1: ep folded over tp, adapters whole)."""


def expert_adapter_params(cfg) -> int:
    """The closed form: rank x (in + out) of every expert's [gate | up] and down."""
    m, r = cfg.model, cfg.model.lora.rank
    h, f = m.hidden_size, m.moe.expert_ffn_size
    return r * ((h + 2 * f) + (f + h)) * m.moe.num_experts * m.num_layers


@pytest.mark.slow
def test_expert_adapters_under_ep_and_tp_match_one_process(data_cache, tmp_path):
    """Each layout against one process with the same micro-batch size (the balance loss acts
    per micro-batch, and its gradient reaches the attention adapters)."""
    results = run_distributed(run_layouts, 4, data_cache, str(tmp_path), LAYOUTS, timeout=600)
    failures = Failures()
    for i, layout in enumerate(LAYOUTS):
        model = tuple(o for o in layout if not o.startswith("--parallel."))
        reference = reference_run(data_cache, f"{tmp_path}/ref{i}", model)
        for rank, per_rank in enumerate(results):
            with failures.check():
                assert_parity(reference, per_rank[i], f"{' '.join(layout)} (rank {rank})",
                              FP64_RTOL)
    failures.raise_any()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits if hasattr(model, "config") else model.eval()(ids)


@pytest.mark.slow
def test_expert_adapters_train_alone_and_merge_into_the_hf_export(tiny_overrides, tmp_path):
    """Two steps: only adapters train and sit in the optimizer (every expert's own pair, the
    closed-form count), the base experts stay as drawn; the merged HF export (Mixtral, one
    matrix per expert) gives the adapted model's logits; a PEFT folder is refused in one
    line, nothing written."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path / "ckpt"
    overrides = tiny_overrides + EXPERTS + ["--model.lora.targets=experts",
                                            "--train.lr=0.05",
                                            f"--checkpoint.dir={root}", "--checkpoint.every=2"]
    cfg = load_config(overrides=overrides + ["--train.steps=2"])
    trainer = Trainer(cfg, log=lambda m: None)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.run()
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(map(is_adapter, trained.values()))
    assert sum(p.numel() for p in trained.values()) == expert_adapter_params(cfg)
    moments = [t for s in trainer.optimizer.adamw.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0]  # AdamW's two fp64 moments, measured
    assert sum(t.numel() * t.element_size() for t in moments) == 2 * 8 * expert_adapter_params(cfg)
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), before[name]) != (name in trained), name
    convert(root, tmp_path / "hf", "hf")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float64, experts_implementation="eager").eval()
    ids = torch.randint(0, 500, (2, 24))
    ours = logits(trainer.model, ids)[..., :merged.config.vocab_size]
    for name, param in trainer.model.named_parameters():  # back to the base: it differs
        param.data.copy_(before[name])
    base = logits(trainer.model, ids)[..., :merged.config.vocab_size]
    assert (ours - base).abs().max() > 1e-3
    # the run's checkpoint (so the export) holds fp32 weights: their rounding, ~6e-8 here
    torch.testing.assert_close(logits(merged, ids), ours, rtol=0, atol=1e-6)
    with pytest.raises(MeshtronError, match="adapters on routed experts") as err:
        convert(root, tmp_path / "peft", "peft")
    assert "\n" not in str(err.value) and not (tmp_path / "peft").exists()


@pytest.mark.parametrize("overrides, message", [
    (MOE + ["--model.lora.rank=65", "--model.lora.targets=experts"],
     "rank=65 is larger than the experts projection's smaller side \\(64\\)"),
    (["--model.lora.rank=4", "--model.lora.targets=experts"],
     "names no projection this model has"),
])
def test_bad_expert_lora_settings_are_one_line(overrides, message):
    with pytest.raises(MeshtronError, match=message) as err:
        load_config(overrides=overrides)
    assert "\n" not in str(err.value)
