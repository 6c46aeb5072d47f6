"""LoRA (model.lora.*): what trains, what the optimizer holds (measured, against the closed
form), adapter checkpoints and their base, the merged Hugging Face export and the PEFT folder
(against ``peft`` itself), and bad input. Parity under every axis: tests/test_lora_parity.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from meshtron.checkpoint.gguf_convert import convert
from meshtron.checkpoint.lora_merge import base_config, seed_weights
from meshtron.checkpoint.model_io import write_model_checkpoint
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TPRegion
from meshtron.parallel.tensor.lora import column_adapter, is_adapter, row_adapter
from meshtron.training.trainer import Trainer

LORA = ["--model.lora.rank=4", "--model.lora.alpha=8", "--model.num_kv_heads=2"]
VOCAB = "--model.vocab_size=512"  # the test tokenizer's: a base written before any run


def adapter_params(cfg) -> int:
    """The closed form: rank x (in + out) per adapted projection, q, [k|v], o, [gate|up] and
    down in every block."""
    m, r = cfg.model, cfg.model.lora.rank
    h, d, f = m.hidden_size, m.head_size, m.ffn_hidden_size
    per_block = (h + m.num_heads * d) + (h + 2 * m.num_kv_heads * d) + (m.num_heads * d + h) \
        + (h + 2 * f) + (f + h)
    return r * per_block * m.num_layers


def train(overrides: list[str], steps: int) -> Trainer:
    """A trainer after ``steps`` steps (its per-step losses as ``trainer.losses``)."""
    cfg = load_config(overrides=overrides + [f"--train.steps={steps}"])
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.losses = trainer.run().losses
    return trainer


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_only_adapters_train_and_the_optimizer_holds_their_state(tiny_overrides, dtype):
    """After two steps: only adapters have gradients and changed; AdamW's moments, measured
    from the optimizer's tensors, are 2 x 8 (fp64) or 2 x 4 bytes per adapter parameter; the
    fp64 run's gradient buckets (what dp reduces) hold exactly the adapters."""
    overrides = tiny_overrides + LORA + [f"--precision.dtype={dtype}", "--train.lr=0.05"]
    before = {n: p.detach().clone()
              for n, p in Trainer(load_config(overrides=overrides + ["--train.steps=1"]),
                                  log=lambda m: None).model.named_parameters()}
    trainer = train(overrides, 2)
    model, optimizer = trainer.model, trainer.optimizer
    size = torch.finfo(torch.float64 if dtype == "fp64" else torch.float32).bits // 8
    expected = adapter_params(trainer.cfg)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(is_adapter(p) for p in trained)
    assert sum(p.numel() for p in trained) == expected
    moments = [t for s in optimizer.adamw.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0]
    assert sum(t.numel() * t.element_size() for t in moments) == 2 * size * expected
    for name, param in model.named_parameters():
        changed = not torch.equal(param.detach(), before[name])
        assert changed == (".lora.b" in name or ".lora.a" in name), name
        assert is_adapter(param) or param.grad is None, name
    if dtype == "fp64":  # buckets: what a data-parallel run reduces
        bucketed = [p for b in optimizer.reducer.buckets for p in b.params]
        assert sum(p.numel() for p in bucketed) == expected and all(map(is_adapter, bucketed))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits if hasattr(model, "config") else model.eval()(ids)


def assert_exports_give_the_adapted_logits(model, base, root, tmp_path) -> str:
    """The merged HF export of the adapter run ``root`` and the HF export of its ``base`` with
    the PEFT folder loaded by ``peft`` give ``model``'s logits (and differ from the base's);
    returns the merged model's transformers class name."""
    import peft
    import transformers

    convert(base, tmp_path / "hf-base", "hf")
    convert(root, tmp_path / "hf-merged", "hf")
    convert(root, tmp_path / "peft", "peft")
    ids = torch.randint(0, 500, (2, 24))
    ours = logits(model, ids).double()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-merged").eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base").eval()
    base_logits = logits(plain, ids).double()
    adapted = peft.PeftModel.from_pretrained(plain, tmp_path / "peft").eval()
    vocab = base_logits.shape[-1]
    assert (ours[..., :vocab] - base_logits).abs().max() > 1e-3  # the adapters do something
    for other in (logits(merged, ids), logits(adapted, ids)):
        assert torch.allclose(other.double(), ours[..., :vocab], atol=2e-5, rtol=0)
    return type(merged).__name__


@pytest.mark.slow
def test_merged_export_and_peft_folder_match_the_adapted_model(tiny_overrides, tmp_path):
    """A LoRA run on a saved base: the merged HF export and the base's HF export with the
    PEFT folder loaded by ``peft`` give the adapted meshtron model's logits; keep_last keeps
    the base the adapters need; a base replaced by another is refused in one line."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    root = tmp_path / "ckpt"
    cfg = base_config(load_config(overrides=tiny_overrides + LORA + ["--train.seed=3", VOCAB]))
    base = write_model_checkpoint(root, cfg, seed_weights(cfg))  # not the run's seed's
    overrides = tiny_overrides + LORA + ["--train.lr=0.05", f"--checkpoint.dir={root}",
                                         "--checkpoint.keep_last=1", "--checkpoint.every=1",
                                         "--checkpoint.resume=true"]  # from the base
    trainer = train(overrides, 3)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        base.name, "step_00000003"]  # steps 1, 2 pruned, the base kept
    assert_exports_give_the_adapted_logits(trainer.model, base, root, tmp_path)
    shutil.rmtree(base)
    other = base_config(load_config(overrides=tiny_overrides + LORA + ["--train.seed=7", VOCAB]))
    write_model_checkpoint(root, other, seed_weights(other))  # another base in its place
    with pytest.raises(MeshtronError, match=r"holds adapters of base model \w+, but"):
        train(overrides, 4)
    with pytest.raises(MeshtronError, match=r"holds adapters of base model \w+, but"):
        convert(root, tmp_path / "hf-again", "hf")


def test_resume_on_another_seed_base_is_refused(tiny_overrides):
    """Adapters trained on the base drawn from one seed, resumed with another seed."""
    resume = ["--checkpoint.resume=true"]
    train(tiny_overrides + LORA + resume, 1)
    with pytest.raises(MeshtronError, match="resume on the base the adapters were trained on"):
        train(tiny_overrides + LORA + resume + ["--train.seed=9"], 2)


@pytest.mark.parametrize("overrides, message", [
    (["--model.lora.rank=200"], "model.lora.rank=200 is larger than the kv projection"),
    (["--model.lora.rank=65", "--model.preset=tiny-mla"],
     "rank=65 is larger than the kv_b projection's smaller side \\(64\\)"),
    (["--model.lora.rank=4", "--model.lora.targets=mlp", "--model.moe.num_experts=4"],
     "names no projection this model has"),
    (["--model.lora.rank=4", "--model.lora.targets=qkv"], "unknown 'qkv'"),
    (["--model.lora.rank=4", "--parallel.tp_comm_overlap=true"], "tp_comm_overlap"),
    (["--model.lora.rank=4", "--model.lora.alpha=0"], "model.lora.alpha must be a positive number"),
])
def test_bad_lora_settings_are_one_line(overrides, message):
    with pytest.raises(MeshtronError, match=message) as err:
        load_config(overrides=overrides)
    assert "\n" not in str(err.value)


def test_base_held_in_bf16_computes_in_the_run_dtype(tiny_overrides, tmp_path):
    """``model.lora.base_dtype=bf16``: the adapted projections' weights take 2 bytes each,
    the adapters and the rest stay fp32, and the losses stay within bf16 rounding of the
    fp32 base's."""
    full = train(tiny_overrides + LORA, 1)
    narrow = train(tiny_overrides + LORA + ["--model.lora.base_dtype=bf16",
                                            f"--run.dir={tmp_path / 'bf16'}"], 1)
    q = narrow.model.layers["0"].attn.q
    assert q.weight.dtype == torch.bfloat16 and q.lora.a.dtype == torch.float32
    assert narrow.model.embed.weight.dtype == torch.float32
    assert full.model.layers["0"].attn.q.weight.dtype == torch.float32
    for a, b in zip(full.losses, narrow.losses, strict=True):
        assert a != b and abs(a - b) < 1e-2 * abs(a)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_an_adapted_layer_adds_the_scaled_low_rank_product(kind):
    """The fused addition (one addmm, the scale inside) is ``x W^T + s (x A^T) B^T``, and the
    adapter's gradients are that formula's, in fp64 to 1e-12; the base gets none."""
    torch.manual_seed(0)
    region = TPRegion(ParallelMesh.single().tp)
    layer = (ColumnParallelLinear if kind == "column" else RowParallelLinear)(
        12, 10, False, region).double()
    make = column_adapter if kind == "column" else row_adapter
    layer.lora = make(layer.weight, 3, 2.5, 0.0, region.group).double()
    for param in (layer.weight, layer.lora.a, layer.lora.b):
        torch.nn.init.normal_(param)
    layer.weight.requires_grad_(False)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    grad = torch.randn(2, 5, 10, dtype=torch.float64)
    layer(x).backward(grad)
    a = layer.lora.a.detach().clone().requires_grad_(True)
    b = layer.lora.b.detach().clone().requires_grad_(True)
    want = x @ layer.weight.T + 2.5 * (x @ a.T) @ b.T
    want.backward(grad)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.lora.a.grad, a.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.lora.b.grad, b.grad, rtol=0, atol=1e-12)
    assert layer.weight.grad is None
