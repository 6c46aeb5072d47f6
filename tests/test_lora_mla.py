"""LoRA on latent attention (``model.attention=mla``): adapters on the query down/up
projections (or the single q), the latent down-projection with its rotary key part, the latent
up-projection and the output projection; parity of tp + sp and cp (the latent travelling the
ring with the adapted ``kv_b``) against one process in fp64 to 1e-9; the weight-absorbed decode
of an adapted model equals the merged model's; the merged DeepSeek-V3 export and the PEFT folder
give the adapted model's logits."""

from __future__ import annotations

import pytest
import torch

from meshtron.checkpoint.lora_merge import base_config, seed_weights
from meshtron.checkpoint.model_io import write_model_checkpoint
from meshtron.config import load_config
from meshtron.models.generation import generate
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from meshtron.parallel.tensor.lora import is_adapter
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import FP64_RTOL, assert_layouts_match, run_layouts
from tests.test_lora import assert_exports_give_the_adapted_logits

LATENT = ["--model.attention=mla", "--model.q_lora_rank=24", "--model.kv_lora_rank=16",
          "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=8", "--model.v_head_dim=12"]
"""On tests/parity.py's 2-layer, 64-wide, 4-head model: every width different."""
LORA = [*LATENT, "--model.lora.rank=4", "--model.lora.alpha=8",
        "--model.lora.targets=attention"]

LAYOUTS = [
    [*LORA, "--precision.dtype=fp64", "--train.lr=0.02", "--train.steps=8", *layout]
    for layout in (["--parallel.tp=2", "--parallel.sp=true"], ["--parallel.cp=2"])
]
"""Heads (q_b, kv_b, proj) split over tp with the whole down projections' adapters replicated
(their gradients summed over tp), the stream sequence-parallel; cp=2 on the ring, the latent
travelling and every rank expanding it with the adapted kv_b."""


@pytest.mark.slow
def test_mla_adapters_keep_parity_under_tp_sp_and_cp(data_cache, tmp_path):
    results = run_distributed(run_layouts, 2, data_cache, str(tmp_path), LAYOUTS, timeout=600)
    assert_layouts_match(LAYOUTS, results, data_cache, tmp_path,
                         rtol_of=lambda layout: FP64_RTOL)


def adapted_and_merged(*overrides: str) -> tuple[Transformer, Transformer]:
    """An adapted fp64 model with every adapter drawn away from zero, and the same model
    without adapters holding ``W + alpha / rank * B A``."""
    common = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_heads=4",
              "--model.ffn_hidden_size=96", "--model.vocab_size=300", "--model.max_seq_len=64",
              *LORA, *overrides]
    cfg = load_config(overrides=common).model
    adapted = Transformer(cfg).double()
    initialize(adapted, seed=3, std=0.2, num_layers=cfg.num_layers)
    gen = torch.Generator().manual_seed(5)
    state = {}
    with torch.no_grad():
        for param in adapted.parameters():
            if is_adapter(param):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        for name, tensor in adapted.state_dict().items():
            if ".lora." not in name:
                state[name] = tensor.clone()
        for name, module in adapted.named_modules():
            if getattr(module, "lora", None) is not None:
                lora = module.lora
                state[f"{name}.weight"] += lora.scale * lora.b @ lora.a
    merged = Transformer(base_config(load_config(overrides=common)).model).double()
    merged.load_state_dict(state)
    return adapted.eval(), merged.eval()


def decode(model: Transformer, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of a prefill then one token at a time (the weight-absorbed steps)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    steps = [model(ids[:, :prefill], cache)]
    steps += [model(ids[:, i:i + 1], cache) for i in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("extra", [(), ("--model.q_lora_rank=0",)])
@torch.no_grad()
def test_adapted_mla_decodes_and_generates_as_the_merged_model(extra):
    """Every projection adapted (q_a, q_b or q, kv_a, kv_b, proj); the cached decode's
    absorbed steps fold the adapted kv_b into query and output exactly as the merged weight
    does, and greedy generation gives the merged model's tokens."""
    adapted, merged = adapted_and_merged(*extra)
    names = {n.split(".attn.")[1].split(".")[0] for n, p in adapted.named_parameters()
             if is_adapter(p)}
    assert names == ({"q"} if extra else {"q_a", "q_b"}) | {"kv_a", "kv_b", "proj"}
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    full = merged(ids)
    assert (adapted(ids) - full).abs().max() <= 1e-10
    assert (decode(adapted, ids, 12) - decode(merged, ids, 12)).abs().max() <= 1e-10
    assert (decode(adapted, ids, 12) - full).abs().max() <= 1e-10
    prompt = ids[0, :6].tolist()
    tokens = generate(adapted, prompt, 12, temperature=0.0)
    assert tokens == generate(merged, prompt, 12, temperature=0.0)
    base = Transformer(merged.cfg).double().eval()
    base.load_state_dict({n: t for n, t in adapted.state_dict().items() if ".lora." not in n})
    assert (base(ids) - full).abs().max() > 1e-2  # the adapters change the model


@pytest.mark.slow
def test_mla_adapters_merge_into_the_deepseek_export_and_the_peft_folder(tiny_overrides,
                                                                         tmp_path):
    """Three steps on a saved base: only adapters train; the merged export (transformers'
    DeepSeek-V3 names) and the base's export with the PEFT folder (q_a_proj, q_b_proj,
    kv_a_proj_with_mqa, kv_b_proj, o_proj) loaded by ``peft`` give the adapted logits."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    root = tmp_path / "ckpt"
    model = [*tiny_overrides, *LORA, "--model.vocab_size=512"]
    cfg = base_config(load_config(overrides=model + ["--train.seed=3"]))
    base = write_model_checkpoint(root, cfg, seed_weights(cfg))
    overrides = model + ["--train.lr=0.05", f"--checkpoint.dir={root}", "--checkpoint.every=3",
                         "--checkpoint.resume=true", "--train.steps=3"]
    trainer = Trainer(load_config(overrides=overrides), log=lambda m: None)
    trainer.run()
    assert all(is_adapter(p) for p in trainer.model.parameters() if p.requires_grad)
    assert assert_exports_give_the_adapted_logits(trainer.model, base, root, tmp_path) == \
        "DeepseekV3ForCausalLM"
