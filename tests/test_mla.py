"""Multi-head latent attention (``model.attention=mla``): the layer against a direct
implementation of DeepSeek's equations and against transformers' ``DeepseekV3Attention``, the
latent KV cache (decode equals recompute, its bytes per token), parameter and FLOP counts, the
presets, bad input, and parity with one process at tp=2 (with sp), pp=2 and cp=2 (ring and
all-to-all, with their bytes)."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.models.arch import architecture_of
from meshtron.models.flops import model_size, training_flops_per_token
from meshtron.models.init import initialize
from meshtron.models.latent import LatentAttention, latent_cache_bytes_per_token
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.plan import check_run

MLA = ("--model.norm_eps=1e-5", "--model.hidden_size=64", "--model.num_heads=4",
       "--model.ffn_hidden_size=96", "--model.num_layers=2", "--model.vocab_size=300",
       "--model.max_seq_len=128", "--train.seq_len=64", "--model.attention=mla",
       "--model.q_lora_rank=24", "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=16",
       "--model.qk_rope_head_dim=8", "--model.v_head_dim=12")
"""Every width different, so a swapped one shows in a shape or a value."""
YARN = ("--model.rope.scaling=yarn", "--model.rope.factor=4", "--model.rope.original_max_len=32",
        "--model.rope.mscale_all_dim=0.707")
TOLERANCE = 1e-5


def mla_model(*overrides: str, seed: int = 3) -> Transformer:
    cfg = load_config(overrides=[*MLA, *overrides]).model
    model = Transformer(cfg)
    initialize(model, seed=seed, std=0.2, num_layers=cfg.num_layers)
    with torch.no_grad():  # norms away from 1, so a dropped one shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn(param.shape, generator=torch.Generator()
                                             .manual_seed(len(name))))
    return model.eval()


def tokens(length: int = 21, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 300, (batch, length), generator=torch.Generator().manual_seed(1))


def reference_attention(attn: LatentAttention, x: torch.Tensor, cfg) -> torch.Tensor:
    """DeepSeek's equations written out: true interleaved rotation by complex products, an
    explicit causal softmax; nothing shared with the layer but its weights."""
    b, s, _ = x.shape
    heads, nope, rope, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
        cfg.v_head_dim

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # DeepSeek's default eps
        return w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)

    if cfg.q_lora_rank:
        q = rms(x @ attn.q_a.weight.T, attn.q_a_norm.weight) @ attn.q_b.weight.T
    else:
        q = x @ attn.q.weight.T
    q = q.view(b, s, heads, nope + rope)
    ckv = x @ attn.kv_a.weight.T
    latent, k_rope = ckv[..., :cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
    kv = (rms(latent, attn.kv_a_norm.weight) @ attn.kv_b.weight.T).view(b, s, heads, nope + vd)
    rotary = LatentAttention.rotary(cfg)
    # the angles (and yarn's factor) of the half-split tables, one per interleaved pair
    cos, sin = rotary.cos[:s, : rope // 2], rotary.sin[:s, : rope // 2]
    turn = torch.polar(torch.hypot(sin, cos), torch.atan2(sin, cos))  # [s, rope / 2]

    def rotate(t: torch.Tensor) -> torch.Tensor:  # pairs (t0, t1), (t2, t3), ...
        pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], rope // 2, 2).contiguous())
        return torch.view_as_real(pairs * turn.view(s, 1, rope // 2)).flatten(-2)

    q_full = torch.cat([q[..., :nope], rotate(q[..., nope:])], dim=-1)
    k_shared = rotate(k_rope.view(b, s, 1, rope))
    k_full = torch.cat([kv[..., :nope], k_shared.expand(b, s, heads, rope)], dim=-1)
    v = kv[..., nope:]
    scale = (nope + rope) ** -0.5
    if cfg.rope.scaling != "none" and cfg.rope.mscale_all_dim:
        scale *= (0.1 * cfg.rope.mscale_all_dim * math.log(cfg.rope.factor) + 1) ** 2
    scores = torch.einsum("bqhd,bkhd->bhqk", q_full, k_full) * scale
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    y = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, heads * vd)
    return y @ attn.proj.weight.T


@pytest.mark.parametrize("extra", [(), ("--model.q_lora_rank=0",), YARN])
@torch.no_grad()
def test_layer_equals_direct_reference(extra):
    model = mla_model(*extra)
    attn = model.layers["0"].attn
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(2))
    ours = attn(x, model.rotary)
    assert (ours - reference_attention(attn, x, model.cfg)).abs().max() <= TOLERANCE


@pytest.mark.parametrize("extra", [(), ("--model.q_lora_rank=0",), YARN])
@torch.no_grad()
def test_layer_equals_transformers_deepseek_v3_attention(extra):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from meshtron.models.arch.deepseek import deepseek_config

    model = mla_model(*extra)
    cfg = model.cfg
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=128,
        rope_parameters=deepseek_config(cfg).get("rope_parameters"))
    hf_cfg._attn_implementation = "eager"
    theirs = ds.DeepseekV3Attention(hf_cfg, 0).eval()
    ours = model.layers["0"].attn
    names = {"kv_a_proj_with_mqa": ours.kv_a, "kv_a_layernorm": ours.kv_a_norm,
             "kv_b_proj": ours.kv_b, "o_proj": ours.proj}
    names.update({"q_a_proj": ours.q_a, "q_a_layernorm": ours.q_a_norm, "q_b_proj": ours.q_b}
                 if cfg.q_lora_rank else {"q_proj": ours.q})
    for name, module in names.items():
        getattr(theirs, name).weight.copy_(module.weight)
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(13)[None]
    cos_sin = ds.DeepseekV3RotaryEmbedding(hf_cfg)(x, positions)
    mask = torch.full((13, 13), float("-inf")).triu(1)[None, None]
    expected = theirs(x, cos_sin, mask)[0]
    assert (ours(x, model.rotary) - expected).abs().max() <= TOLERANCE


@torch.no_grad()
def test_latent_cache_decode_equals_full_recompute_and_its_size():
    model = mla_model(*YARN)
    x = tokens(24, batch=1)
    full = model(x)
    cache = model.new_cache(1, 24)
    steps = [model(x[:, :9], cache)]  # a prefill, one token at a time, then a chunk
    steps += [model(x[:, i : i + 1], cache) for i in range(9, 16)]
    steps.append(model(x[:, 16:], cache))
    assert (torch.cat(steps, dim=1) - full).abs().max() <= TOLERANCE
    cfg = model.cfg
    per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # fp32
    assert cache.bytes_per_token == per_token == latent_cache_bytes_per_token(cfg, 4)
    assert per_token == 2 * (16 + 8) * 4  # against 2 layers x 4 heads x (k 24 + v 12) x 4 bytes


@torch.no_grad()
def test_weight_absorbed_decode_equals_the_expanded_one():
    """A decode step folds kv_b into the query and output (never expanding the cache): the
    same attention as expanding every cached latent, to fp64 rounding."""
    model = mla_model(*YARN).double()
    x = tokens(20, batch=2)
    logits = {}
    for absorb in (True, False):
        for block in model.blocks():
            block.attn.absorb = absorb
        cache = model.new_cache(2, 20)
        model(x[:, :12], cache)
        logits[absorb] = torch.cat([model(x[:, i:i + 1], cache) for i in range(12, 20)], dim=1)
    assert (logits[True] - logits[False]).abs().max() <= 1e-12
    calls = []
    attn = model.blocks()[0].attn
    attn.absorb = True
    attn.absorbed_core = lambda *args: calls.append(1) or type(attn).absorbed_core(attn, *args)
    cache = model.new_cache(2, 20)
    model(x[:, :12], cache)
    model(x[:, 12:13], cache)
    assert calls == [1]  # the prefill expands, the one-token step absorbs


@pytest.mark.parametrize("extra", [(), ("--model.q_lora_rank=0",),
                                   ("--model.moe.num_experts=4", "--model.moe.score=sigmoid",
                                    "--model.moe.shared_experts=1", "--model.moe.dense_layers=1",
                                    "--model.moe.expert_ffn_size=32")])
def test_parameter_and_flop_counts_follow_the_formula(extra):
    cfg = load_config(overrides=[*MLA, *extra]).model
    h, heads, q_rank, kv_rank = 64, 4, cfg.q_lora_rank, 16
    nope, rope, vd = 16, 8, 12
    query = h * q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
    attention = query + h * (kv_rank + rope) + kv_rank * heads * (nope + vd) + heads * vd * h
    model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_size(cfg).params == total
    attn_params = sum(p.numel() for n, p in model.named_parameters()
                      if n.startswith("layers.0.attn.") and not n.endswith("norm.weight"))
    assert attn_params == attention == LatentAttention.matmul_params(cfg)
    if not cfg.is_moe:
        matmul = 2 * (attention + 3 * h * 96) + 384 * h
        assert model_size(cfg).matmul_params == matmul
        scores = 6 * 2 * 64 * heads * (nope + rope + vd)
        assert training_flops_per_token(cfg, 64) == 6 * matmul + scores


def test_deepseek_v3_preset_has_the_published_size():
    cfg = load_config(overrides=["--model.preset=deepseek-v3"]).model
    assert architecture_of(cfg).attention is LatentAttention
    size = model_size(cfg)
    # 671.03B and 36.6B active per token, without the multi-token-prediction module (see
    # tests/test_mtp.py), as published
    assert round((size.params - size.mtp_params) / 1e9) == 671
    assert round((size.matmul_params - size.mtp_matmul_params) / 1e9) == 37


def test_tiny_presets_train_a_step():
    from meshtron.models.init import initialize as init

    for preset in ("tiny-mla", "tiny-deepseek"):
        cfg = load_config(overrides=[f"--model.preset={preset}", "--model.vocab_size=300"])
        check_run(cfg, 1)
        model = Transformer(cfg.model, options=ModelOptions(aux_loss_weight=lambda: 1.0))
        init(model, seed=0, std=0.02, num_layers=cfg.model.num_layers)
        mb = SequenceSplit(ParallelMesh.single().cp, mtp_depth=cfg.model.mtp_depth)(tokens(33))
        loss = model.loss_sum(model.train()(mb.tokens, ahead=mb.ahead), mb.targets)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), preset


BAD = {
    ("--model.qk_rope_head_dim=7",): "model.qk_rope_head_dim=7 must be even",
    ("--model.kv_lora_rank=0",): "model.kv_lora_rank must be a positive integer",
    ("--model.q_lora_rank=-1",): "model.q_lora_rank must not be negative",
    ("--model.attention=gqa",): "model.attention='gqa' is not one of mha, mla",
    ("--model.qk_norm=true",): "model.qk_norm does not combine with model.attention=mla",
    ("--model.sliding_window=8",): "model.sliding_window does not combine with",
    ("--model.num_kv_heads=2",): "model.num_kv_heads=2 with model.attention=mla",
    ("--model.arch=gpt2",): "model.attention=mla needs model.arch=llama",
}


def test_bad_latent_settings_are_one_line_each():
    for overrides, fragment in BAD.items():
        with pytest.raises(MeshtronError) as err:
            load_config(overrides=[*MLA, *overrides])
        assert fragment in str(err.value) and "\n" not in str(err.value), (overrides, err.value)
    plain = [o for o in MLA if not o.startswith("--model.v_head_dim")]
    with pytest.raises(MeshtronError, match="model.attention=mla needs model.v_head_dim"):
        load_config(overrides=plain)
    mha = [o for o in MLA if not o.startswith("--model.attention")]
    with pytest.raises(MeshtronError, match="model.q_lora_rank is a latent-attention setting"):
        load_config(overrides=mha)
    layouts = {
        ("--parallel.tp=3",): "parallel.tp=3 does not divide model.num_heads=4",
        ("--parallel.cp=2", "--train.seq_len=62"): "2*cp = 4 equal chunks: train.seq_len=62",
        ("--precision.fp8=blockwise", "--precision.fp8_block=16"):
            "model.kv_lora_rank + model.qk_rope_head_dim = 24 divisible by",
    }
    for overrides, fragment in layouts.items():
        cfg = load_config(overrides=[*MLA, *overrides, "--model.ffn_hidden_size=96"])
        with pytest.raises(MeshtronError) as err:
            check_run(cfg, 6 if "--parallel.tp=3" in overrides else 2)
        assert fragment in str(err.value) and "\n" not in str(err.value), (overrides, err.value)


# ----------------------------------------------------------------------------- parallel

LATENT = ["--model.attention=mla", "--model.q_lora_rank=24", "--model.kv_lora_rank=16",
          "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=8", "--model.v_head_dim=12",
          "--model.rope.scaling=yarn", "--model.rope.factor=4",
          "--model.rope.original_max_len=16", "--model.rope.mscale_all_dim=1"]
"""On tests/parity.py's 2-layer, 64-wide, 4-head model."""


CP_LAYERS, CP_SEQS, CP_LEN = 2, 8, 32
"""tests/parity.py's layers, sequences per step and sequence length."""


def assert_cp_bytes(run_dir, cfg, comm: str) -> None:
    """The step's cp bytes (step 5 of the run) against the closed form: the ring sends the
    latent and rotated key, (kv_lora_rank + qk_rope_head_dim) values per token, (cp − 1)
    times forward (twice: selective recompute runs it again in backward) and 2(cp − 1) + 1
    times backward with their gradients; all-to-all sends (cp − 1)/cp of the expanded q, k, v
    and the output forward and of their gradients backward."""
    import json
    from pathlib import Path

    row = json.loads(Path(run_dir, "metrics.jsonl").read_text().splitlines()[0])
    m, cp, fp32 = cfg.model, 2, 4
    tokens = CP_SEQS * CP_LEN // cp  # this rank's, over the step's micro-batches
    qk, heads = m.qk_nope_head_dim + m.qk_rope_head_dim, m.num_heads
    if comm == "ring":
        block = tokens * (m.kv_lora_rank + m.qk_rope_head_dim) * fp32
        sent = row["comm_bytes"]["cp/send"]
        assert sent == CP_LAYERS * (2 * (cp - 1) * block + (cp - 1) * 2 * block + block), sent
        # 24 values per token, where the heads' k and v would be 4 x (8 + 8 + 12) = 112
        assert (m.kv_lora_rank + m.qk_rope_head_dim, heads * (qk + m.v_head_dim)) == (24, 112)
    else:
        tensors = tokens * heads * (2 * qk + 2 * m.v_head_dim) * fp32  # q, k, v, output
        sent = row["comm_bytes"]["cp/all_to_all"]
        assert sent == CP_LAYERS * 2 * tensors * (cp - 1) // cp, sent


@pytest.mark.slow
def test_latent_attention_keeps_parity_at_tp2_sp_pp2_and_cp2(data_cache, tmp_path):
    """Heads split over tp with the down projections and latent norms whole on both ranks
    (their gradients summed over tp), the stream sequence-parallel; two pipeline stages; and
    cp=2, the latent travelling the ring (each rank expanding every block it meets; under
    selective recompute) or the expanded heads all-to-all, with the bytes of both.
    (tiny-mla's own widths on this 64-wide model train so unstably that its one-process fp32
    run leaves its fp64 twin by 7e-4 at step 13: no layout could be held to 1e-4 there.)"""
    from tests.distributed import run_distributed
    from tests.parity import assert_layouts_match, run_layouts, test_overrides

    cp = ["--parallel.cp=2", *LATENT]
    layouts = [["--parallel.tp=2", "--parallel.sp=true", *LATENT],
               ["--parallel.pp=2", "--train.micro_batch=2", *LATENT],
               [*cp, "--train.recompute=selective"], ["--parallel.cp_comm=all_to_all", *cp]]
    results = run_distributed(run_layouts, 2, data_cache, str(tmp_path), layouts)
    assert_layouts_match(layouts, results, data_cache, tmp_path)
    cfg = load_config(overrides=test_overrides(data_cache, "unused") + cp)
    assert (cfg.model.num_layers, cfg.train.global_batch, cfg.train.seq_len) == (
        CP_LAYERS, CP_SEQS, CP_LEN)
    assert_cp_bytes(tmp_path / "layout2", cfg, "ring")
    assert_cp_bytes(tmp_path / "layout3", cfg, "all_to_all")
