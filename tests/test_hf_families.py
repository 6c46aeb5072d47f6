"""`meshtron convert` for the Hugging Face families and settings beyond plain Llama / Mixtral /
GPT-2: Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, explicit head_dim), Qwen3-MoE, Llama's
head_dim / attention_bias / mlp_bias and its linear, llama3 and yarn rope scaling, Mistral and
Mixtral sliding windows, Mixtral top-1 routing.

Models are built locally from a config (nothing is downloaded) and every weight is randomised,
norms and biases included, so a dropped, swapped or zero tensor shows in the logits. Each case
is imported (logits within 1e-5 of transformers in fp32), exported back (tensors bit-identical)
and reloaded in transformers (the same logits); models built in meshtron go the other way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtron.checkpoint.hf_convert import convert, hf_model_config
from meshtron.checkpoint.hf_mapping import hf_format
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.config import load_config
from meshtron.config.sections import RopeConfig
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize
from meshtron.models.rotary import inverse_frequencies
from meshtron.models.transformer import Transformer
from tests.test_hf_convert import SHAPE, cli_error, max_diff

TOLERANCE = 1e-5
HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
"""hidden / heads = 16: head_dim=32 below is the 'explicit head_dim that differs' case."""
MOE_SHAPE = dict(moe_intermediate_size=32, num_experts=4)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}

HF_CASES = {  # name: (config class, its arguments beyond HF_SHAPE, what the import must say)
    "qwen2": ("Qwen2Config", {}, dict(qkv_bias=True, proj_bias=False)),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8,
                                         max_window_layers=0), dict(sliding_window=8)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=True, tie_word_embeddings=True),
              dict(qk_norm=True, head_dim=32, qkv_bias=True, proj_bias=True)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts_per_tok=2, mlp_only_layers=[0],
                                         **MOE_SHAPE), dict(qk_norm=True, head_dim=32)),
    "qwen3-moe-top1": ("Qwen3MoeConfig", dict(num_experts_per_tok=1, norm_topk_prob=True,
                                              decoder_sparse_step=2, **MOE_SHAPE),
                       dict(qk_norm=True)),
    "llama-head-dim-biases": ("LlamaConfig", dict(head_dim=32, attention_bias=True,
                                                  mlp_bias=True),
                              dict(head_dim=32, qkv_bias=True, proj_bias=True, mlp_bias=True)),
    "llama-rope-linear": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), {}),
    "llama3.1-rope": ("LlamaConfig", dict(rope_parameters=LLAMA3), {}),
    "llama-rope-yarn": ("LlamaConfig", dict(rope_parameters=YARN), {}),
    "llama-rope-yarn-mscale": ("LlamaConfig", dict(rope_parameters={
        **YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False, "beta_fast": 16.0}), {}),
    "mistral-window": ("MistralConfig", dict(sliding_window=8, head_dim=32),
                       dict(sliding_window=8, head_dim=32)),
    "mixtral-top1-window": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=1,
                                                  sliding_window=8, intermediate_size=32),
                            dict(sliding_window=8)),
}
EXPECTED_MOE = {
    "qwen3-moe": dict(top_k=2, dense_layers=1, every=1, normalize_topk=False, expert_ffn_size=32),
    "qwen3-moe-top1": dict(top_k=1, dense_layers=1, every=1, normalize_topk=True),
    "mixtral-top1-window": dict(top_k=1, normalize_topk=True),
}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 3, skip: str = "expert_bias") -> None:
    """Every weight drawn anew: norms around 1, the rest around 0 (biases and routers too)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if skip in name:
            continue
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)


def tokens(vocab: int, length: int = 29) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))


def meshtron_model(checkpoint: Path) -> Transformer:
    cfg, state = read_model_tensors(checkpoint)
    model = Transformer(cfg.model)
    model.load_state_dict(state)
    return model.eval()


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_family_imports_with_parity_and_round_trips(tmp_path, transformers, case):
    config_class, extra, expected = HF_CASES[case]
    config = getattr(transformers, config_class)(**{**HF_SHAPE, **extra})
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path / "src")
    checkpoint = convert(tmp_path / "src", tmp_path / "ckpt").output
    cfg = read_model_tensors(checkpoint)[0].model
    for key, value in expected.items():
        assert getattr(cfg, key) == value, (key, getattr(cfg, key))
    for key, value in EXPECTED_MOE.get(case, {}).items():
        assert getattr(cfg.moe, key) == value, (key, getattr(cfg.moe, key))
    x = tokens(256)
    with torch.no_grad():
        theirs = hf(x).logits
        assert max_diff(meshtron_model(checkpoint)(x), theirs) <= TOLERANCE

    assert_round_trip(transformers, tmp_path, hf, x, theirs)


def assert_round_trip(transformers, tmp_path: Path, hf, x: torch.Tensor,
                      theirs: torch.Tensor) -> None:
    """``tmp_path/ckpt`` (imported from ``tmp_path/src``) exports back bit for bit, and
    transformers loads the export as the same class with the same logits."""
    convert(tmp_path / "ckpt", tmp_path / "back", "hf")
    original, back = hf_tensors(tmp_path / "src"), hf_tensors(tmp_path / "back")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(hf)
    with torch.no_grad():
        assert max_diff(again(x).logits, theirs) <= TOLERANCE


MESHTRON_CASES = {  # name: (overrides on test_hf_convert's SHAPE, the HF class it exports as)
    "qwen3": (("--model.qk_norm=true", "--model.head_dim=32", "--model.num_kv_heads=2"),
              "Qwen3ForCausalLM"),
    "qwen3-biases-window": (("--model.qk_norm=true", "--model.qkv_bias=true",
                             "--model.proj_bias=true", "--model.sliding_window=16"),
                            "Qwen3ForCausalLM"),
    "qwen2": (("--model.qkv_bias=true", "--model.rope.scaling=linear",
               "--model.rope.factor=4"), "Qwen2ForCausalLM"),
    "llama": (("--model.qkv_bias=true", "--model.proj_bias=true", "--model.mlp_bias=true",
               "--model.head_dim=8", "--model.rope.scaling=yarn", "--model.rope.factor=4",
               "--model.rope.original_max_len=32"), "LlamaForCausalLM"),
    "mistral": (("--model.sliding_window=16", "--model.rope.scaling=llama3",
                 "--model.rope.factor=8", "--model.rope.original_max_len=32"),
                "MistralForCausalLM"),
    "qwen3-moe": (("--model.qk_norm=true", "--model.moe.num_experts=4", "--model.moe.top_k=2",
                   "--model.moe.expert_ffn_size=32", "--model.moe.dense_layers=1",
                   "--model.moe.normalize_topk=false", "--model.moe.aux_loss=0.02"),
                  "Qwen3MoeForCausalLM"),
    "mixtral-top1-window": (("--model.moe.num_experts=4", "--model.moe.top_k=1",
                             "--model.moe.expert_ffn_size=32", "--model.sliding_window=16"),
                            "MixtralForCausalLM"),
}


@pytest.mark.parametrize("case", list(MESHTRON_CASES))
def test_meshtron_model_exports_to_its_family(tmp_path, transformers, case):
    overrides, hf_class = MESHTRON_CASES[case]
    cfg = load_config(overrides=[*SHAPE, *overrides])
    model = Transformer(cfg.model)
    initialize(model, seed=7, std=0.02, num_layers=cfg.model.num_layers)
    randomize(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_model_checkpoint(tmp_path / "ckpt", cfg, state)
    convert(tmp_path / "ckpt", tmp_path / "hf", "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [hf_class]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens(300, 37)  # longer than the windows of 16
    with torch.no_grad():
        assert max_diff(model.eval()(x), hf(x).logits) <= TOLERANCE

    back = convert(tmp_path / "hf", tmp_path / "back").output
    back_cfg, back_state = read_model_tensors(back)
    assert back_cfg.model == cfg.model
    assert all(torch.equal(back_state[k], state[k]) for k in state)


def test_rope_frequencies_equal_transformers(transformers):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = {
        "linear": ({"rope_type": "linear", "factor": 2.5}, RopeConfig("linear", 2.5)),
        "llama3": (LLAMA3, RopeConfig("llama3", 8.0, 32, 1.0, 4.0)),
        "yarn": (YARN, RopeConfig("yarn", 4.0, 32)),
        "yarn-untruncated": ({**YARN, "truncate": False, "beta_fast": 8, "beta_slow": 2,
                              "attention_factor": 0.9},
                             RopeConfig("yarn", 4.0, 32, beta_fast=8, beta_slow=2,
                                        attention_factor=0.9, truncate=False)),
    }
    for name, (params, rope) in cases.items():
        theta = params.get("rope_theta", 10000.0)
        config = transformers.LlamaConfig(**HF_SHAPE, head_dim=32,
                                          rope_parameters={"rope_theta": theta, **params})
        theirs, their_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        ours, our_factor = inverse_frequencies(32, theta, rope, 128)
        assert torch.equal(ours, theirs.float()), name
        assert our_factor == pytest.approx(their_factor, rel=1e-12), name


# ----------------------------------------------------------------------------- meshtron only


def windowed(*overrides: str) -> Transformer:
    cfg = load_config(overrides=[*SHAPE, "--model.num_kv_heads=2", *overrides])
    model = Transformer(cfg.model)
    initialize(model, seed=5, std=0.2, num_layers=2)
    return model.eval()


@torch.no_grad()
def test_sliding_window_decode_equals_full_recompute():
    model = windowed("--model.sliding_window=6", "--model.qk_norm=true", "--model.head_dim=8")
    x = tokens(300, 24)[:1]
    full = model(x)
    cache = model.new_cache(1, 24)
    steps = [model(x[:, :9], cache)]  # a prefill longer than the window, then one by one
    steps += [model(x[:, i : i + 1], cache) for i in range(9, 16)]
    steps.append(model(x[:, 16:], cache))  # a chunk after the prefix
    assert max_diff(torch.cat(steps, dim=1), full) <= 1e-5
    unwindowed = windowed("--model.qk_norm=true", "--model.head_dim=8")
    unwindowed.load_state_dict(model.state_dict())
    assert max_diff(unwindowed(x)[:, 6:], full[:, 6:]) > 1e-3  # the window binds
    assert max_diff(unwindowed(x)[:, :6], full[:, :6]) <= 1e-6  # and only beyond its width


@pytest.mark.parametrize("overrides", [
    ("--model.qk_norm=true", "--model.head_dim=24", "--model.qkv_bias=true",
     "--model.proj_bias=true", "--model.mlp_bias=true"),
    ("--model.qk_norm=true", "--model.qkv_bias=true", "--model.moe.num_experts=4",
     "--model.moe.dense_layers=1", "--model.moe.expert_ffn_size=32"),
])
def test_parameter_count_covers_the_new_tensors(overrides):
    from meshtron.models.flops import model_size

    cfg = load_config(overrides=[*SHAPE, *overrides]).model
    model = Transformer(cfg)
    assert model_size(cfg).params == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_window_mask_is_hf_sliding_window():
    from meshtron.models.blocks import window_mask

    index = torch.arange(10)
    docs = torch.tensor([[0] * 4 + [1] * 6])
    mask = window_mask(index, index, 3, docs, docs)[0, 0]
    for i in range(10):
        for j in range(10):  # HF: causal and kv_idx > q_idx - window; meshtron: within documents
            assert bool(mask[i, j]) == (j <= i and j > i - 3 and docs[0, i] == docs[0, j])


def test_hf_refusals_are_one_line_each():
    base = dict(HF_SHAPE, model_type="qwen2")
    refused = {
        "mixed windows": (dict(base, use_sliding_window=True, sliding_window=8,
                               max_window_layers=1), "sliding windows on some layers only"),
        "dynamic rope": (dict(base, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
                         "rope scaling 'dynamic' is not supported"),
        "llama3 incomplete": (dict(base, rope_parameters={"rope_type": "llama3", "factor": 8.0}),
                              "rope scaling 'llama3' needs 'low_freq_factor'"),
        "expert pattern": (dict(HF_SHAPE, model_type="qwen3_moe", num_hidden_layers=4,
                                mlp_only_layers=[2], num_experts_per_tok=2, **MOE_SHAPE),
                           "experts on layers [0, 1, 3]"),
        "qwen2 mlp bias": (dict(base, mlp_bias=True), "mlp_bias=true is not a Qwen2 setting"),
        "mistral bias": (dict(base, model_type="mistral", attention_bias=True),
                         "attention_bias=true is not a Mistral setting"),
    }
    for name, (config, fragment) in refused.items():
        with pytest.raises(MeshtronError) as err:
            hf_model_config(config)
        assert fragment in str(err.value) and "\n" not in str(err.value), name


EXPORT_REFUSALS = {
    "output bias alone": (("--model.proj_bias=true",),
                          "model.proj_bias without model.qkv_bias"),
    "window with biases": (("--model.sliding_window=16", "--model.qkv_bias=true",
                            "--model.proj_bias=true"),
                           "no Hugging Face Mistral equivalent: model.qkv_bias, model.proj_bias"),
    "qwen3 half biases": (("--model.qk_norm=true", "--model.qkv_bias=true"),
                          "no Hugging Face Qwen3 equivalent: model.qkv_bias=true with "
                          "model.proj_bias=false"),
    "mixtral biases": (("--model.moe.num_experts=4", "--model.qkv_bias=true"),
                       "no Hugging Face Mixtral equivalent: model.qkv_bias=true"),
    "qwen3-moe shared": (("--model.moe.num_experts=4", "--model.qk_norm=true",
                          "--model.moe.shared_experts=1"),
                         "no Hugging Face Qwen3-MoE equivalent: model.moe.shared_experts=1"),
}


@pytest.mark.parametrize("case", list(EXPORT_REFUSALS))
def test_export_refusals_name_the_setting(tmp_path, capsys, case):
    overrides, fragment = EXPORT_REFUSALS[case]
    cfg = load_config(overrides=[*SHAPE, *overrides, "--model.moe.expert_ffn_size=32"])
    with pytest.raises(MeshtronError, match=fragment):
        hf_format(cfg.model)
    model = Transformer(cfg.model)
    initialize(model, seed=1, std=0.02, num_layers=2)
    write_model_checkpoint(tmp_path / "ckpt", cfg,
                           {k: v.detach() for k, v in model.state_dict().items()})
    line = cli_error(capsys, "convert", "--from", tmp_path / "ckpt", "--to", tmp_path / "hf",
                     "--format", "hf")
    assert fragment in line
    assert not (tmp_path / "hf").exists()


def test_bad_model_settings_are_one_line_each():
    cases = {
        "--model.head_dim=7": "model.head_dim=7 must be even",
        "--model.head_dim=0": "model.head_dim must be a positive integer",
        "--model.sliding_window=0": "model.sliding_window must be a positive integer",
        "--model.rope.scaling=ntk": "model.rope.scaling='ntk' is not one of none, linear",
        "--model.rope.factor=-2": "model.rope.factor must be a positive number",
        "--model.rope.original_max_len=0": "model.rope.original_max_len must be a positive",
    }
    for override, fragment in cases.items():
        with pytest.raises(MeshtronError) as err:
            load_config(overrides=[*SHAPE, override])
        assert fragment in str(err.value), (override, str(err.value))
    with pytest.raises(MeshtronError, match="model.mlp_bias is not supported with routed"):
        load_config(overrides=[*SHAPE, "--model.mlp_bias=true", "--model.moe.num_experts=4"])
    with pytest.raises(MeshtronError, match="model.qk_norm is a llama-arch setting"):
        load_config(overrides=[*SHAPE, "--model.arch=gpt2", "--model.qk_norm=true"])
    with pytest.raises(MeshtronError, match="high_freq_factor=1.0 must exceed"):
        load_config(overrides=[*SHAPE, "--model.rope.scaling=llama3",
                               "--model.rope.high_freq_factor=1"])
    head_dim = load_config(overrides=[*SHAPE, "--model.hidden_size=60", "--model.head_dim=16"])
    assert head_dim.model.head_size == 16  # 60 / 4 heads need not divide with head_dim set


# ----------------------------------------------------------------------------- parallel

QWEN_STYLE = ["--model.qk_norm=true", "--model.head_dim=8", "--model.qkv_bias=true",
              "--model.proj_bias=true", "--model.mlp_bias=true", "--model.sliding_window=8",
              "--model.rope.scaling=yarn", "--model.rope.factor=4",
              "--model.rope.original_max_len=16"]
"""Every new block setting at once; the window (8) is shorter than train.seq_len (32)."""


@pytest.mark.slow
def test_new_block_settings_keep_tensor_parallel_parity(data_cache, tmp_path):
    """q/k norms (one weight per head width, summed over tp; kv heads shared by both ranks),
    biases split like their weights, the window and yarn, at tp=2 with sp vs one process."""
    from tests.distributed import run_distributed
    from tests.parity import assert_layouts_match, run_layouts

    layouts = [["--parallel.tp=2", "--parallel.sp=true", "--model.num_kv_heads=1", *QWEN_STYLE],
               ["--parallel.tp=2", "--data.document_mask=true", *QWEN_STYLE]]
    results = run_distributed(run_layouts, 2, data_cache, str(tmp_path), layouts)
    assert_layouts_match(layouts, results, data_cache, tmp_path)


def test_window_with_context_parallelism_is_refused_by_the_plan():
    from meshtron.plan import check_run

    cfg = load_config(overrides=[*SHAPE, "--model.sliding_window=16", "--parallel.cp=2"])
    with pytest.raises(MeshtronError) as err:
        check_run(cfg, 2)  # before any process group exists
    assert "model.sliding_window=16 does not combine with parallel.cp=2" in str(err.value)
    check_run(load_config(overrides=[*SHAPE, "--model.sliding_window=128", "--parallel.cp=2"]), 2)


def test_head_width_checks_and_memory_use_the_explicit_head_dim():
    """hidden / heads = 64 / 4 = 16 is even and a whole FP8 block; the real width decides."""
    from meshtron.costmodel.activations import activation_bytes_per_layer
    from meshtron.plan import check_run
    from meshtron.training.memory import measure_saved_bytes

    odd = load_config(overrides=[*SHAPE, "--model.hidden_size=60", "--model.head_dim=16"])
    check_run(odd, 1)  # 60 / 4 = 15 is odd, the heads are 16 wide
    blocks = ["--precision.fp8=blockwise", "--precision.fp8_block=32", "--model.num_kv_heads=1"]
    check_run(load_config(overrides=[*SHAPE, *blocks, "--model.head_dim=32"]), 1)
    with pytest.raises(MeshtronError, match="kv heads x head dim per tp rank = 16"):
        check_run(load_config(overrides=[*SHAPE, *blocks, "--model.head_dim=16"]), 1)
    x = tokens(300, 17)
    saved = []
    for layers in (1, 2):
        cfg = load_config(overrides=[*SHAPE, "--model.head_dim=24",
                                     f"--model.num_layers={layers}"]).model
        model = Transformer(cfg)
        initialize(model, seed=0, std=0.02, num_layers=layers)
        saved.append(measure_saved_bytes(model, x))
    assert saved[1] - saved[0] == activation_bytes_per_layer(cfg, 2, 16)
