"""Gemma 3 (``model.arch=gemma3``) against transformers' ``Gemma3ForCausalLM``, and under the mesh.

A small text-only model is built locally (nothing is downloaded): 6 layers so that both the
sliding-window and the global kind appear (five local layers, then one global), a window of 8
shorter than every sequence, one kv head, head_dim 32 apart from hidden / heads = 16, a
query_pre_attn_scalar apart from head_dim, linear rope scaling on the global layers only, a
final logit soft-cap. Every weight is drawn anew (norm offsets included), so a dropped,
swapped or misapplied part shows in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.hf_convert import convert, hf_model_config
from meshtron.checkpoint.hf_mapping import hf_format
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.models.generation import Generator
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from tests.test_hf_convert import max_diff, write_tokenizer
from tests.test_hf_families import assert_round_trip, meshtron_model, tokens

TOLERANCE = 1e-5
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                max_position_embeddings=128, sliding_window=8, query_pre_attn_scalar=24,
                final_logit_softcapping=30.0, rope_parameters=ROPE, eos_token_id=None)
EXPECTED = dict(arch="gemma3", num_layers=6, num_kv_heads=1, head_dim=32, qk_norm=True,
                sliding_window=8, sliding_window_pattern=6, rope_theta=1e6,
                rope_local_theta=1e4, query_pre_attn_scalar=24.0, logit_softcap=30.0,
                tie_embeddings=True, norm_eps=1e-6)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 3) -> None:
    """Every weight drawn anew; Gemma's norm weights are offsets from 1, drawn around 0."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        scale = 0.3 if "norm" in name else 0.1
        param.copy_(scale * torch.randn(param.shape, generator=gen))


def hf_gemma3(transformers, **extra) -> torch.nn.Module:
    config = transformers.Gemma3TextConfig(**{**HF_SHAPE, **extra})
    model = transformers.Gemma3ForCausalLM(config).eval()
    randomize(model)
    return model


@pytest.fixture(scope="module")
def imported(transformers, tmp_path_factory) -> tuple[torch.nn.Module, Transformer, Path]:
    """(the transformers model, its meshtron import through ``convert``, the folder holding
    ``src``, the HF model, and ``ckpt``, the import), built once for the tests below."""
    root = tmp_path_factory.mktemp("gemma3")
    hf = hf_gemma3(transformers)
    hf.save_pretrained(root / "src")
    write_tokenizer(root / "src" / "tokenizer.json")  # generate's loader wants one
    checkpoint = convert(root / "src", root / "ckpt").output
    return hf, meshtron_model(checkpoint), root


def test_gemma3_imports_with_parity_and_round_trips(transformers, imported):
    hf, model, root = imported
    cfg = model.cfg
    for key, value in EXPECTED.items():
        assert getattr(cfg, key) == value, (key, getattr(cfg, key))
    assert cfg.rope.scaling == "linear" and cfg.rope.factor == 2.0
    assert [cfg.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    x = tokens(256)  # 29 positions: past the window
    with torch.no_grad():
        theirs = hf(x).logits
        assert max_diff(model(x), theirs) <= TOLERANCE
    assert_round_trip(transformers, root, hf, x, theirs)


def test_older_config_form_reads_the_same(tmp_path, transformers):
    """``sliding_window_pattern``, ``rope_theta``, ``rope_local_base_freq`` and
    ``rope_scaling`` (config files of transformers 4) give the model that ``layer_types`` and
    per-layer-type ``rope_parameters`` give."""
    hf = hf_gemma3(transformers)
    hf.save_pretrained(tmp_path / "src")
    new = json.loads((tmp_path / "src" / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old.update(sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert hf_model_config(old) == hf_model_config(new)
    three = dict(old, sliding_window_pattern=3, rope_scaling=None)
    cfg = hf_model_config(three)
    assert cfg.sliding_window_pattern == 3 and cfg.rope.scaling == "none"


@pytest.mark.slow
@torch.no_grad()
def test_gemma3_generation_equals_transformers(imported):
    """Greedy decoding with the KV cache (two prompts batched with left padding) gives
    transformers' tokens for 32 steps, across windows; every cached step's logits equal a
    full forward over the same tokens."""
    hf, model, _ = imported
    prompts = PROMPTS
    ours, _ = Generator(model).generate(prompts, 32)
    for prompt, completion in zip(prompts, ours):
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert completion.tokens == theirs[0, len(prompt):].tolist()
    sequence = torch.tensor([prompts[0] + ours[0].tokens])
    full = model(sequence)
    cache = model.new_cache(1, sequence.shape[1])
    steps = [model(sequence[:, :7], cache)]
    steps += [model(sequence[:, i:i + 1], cache) for i in range(7, sequence.shape[1])]
    assert max_diff(torch.cat(steps, dim=1), full) <= TOLERANCE


PROMPTS = [tokens(256, 7)[0].tolist(), tokens(256, 3)[1].tolist()]
"""Two prompts of different lengths (batched with left padding), shorter than the window."""


MESHTRON_GEMMA = ("--model.arch=gemma3", "--model.qk_norm=true", "--model.hidden_size=64",
                  "--model.num_heads=4", "--model.num_kv_heads=2", "--model.head_dim=32",
                  "--model.ffn_hidden_size=96", "--model.num_layers=4", "--model.vocab_size=300",
                  "--model.max_seq_len=128", "--model.sliding_window=6",
                  "--model.sliding_window_pattern=2", "--model.rope_local_theta=10000",
                  "--model.rope.scaling=yarn", "--model.rope.factor=4",
                  "--model.rope.original_max_len=32", "--model.logit_softcap=20")


def test_meshtron_gemma3_exports_to_transformers(tmp_path, transformers):
    """A model built in meshtron (untied, yarn on its global layers, a local layer after every
    global one) exports as Gemma3ForCausalLM with equal logits and imports back unchanged."""
    cfg = load_config(overrides=list(MESHTRON_GEMMA))
    model = Transformer(cfg.model)
    initialize(model, seed=7, std=0.02, num_layers=cfg.model.num_layers)
    randomize(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_model_checkpoint(tmp_path / "ckpt", cfg, state)
    convert(tmp_path / "ckpt", tmp_path / "hf", "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens(300, 37)
    with torch.no_grad():
        assert max_diff(model.eval()(x), hf(x).logits) <= TOLERANCE
    back = convert(tmp_path / "hf", tmp_path / "back").output
    back_cfg, back_state = read_model_tensors(back)
    assert back_cfg.model == cfg.model
    assert all(torch.equal(back_state[k], state[k]) for k in state)


def test_gemma3_init_starts_norms_at_one():
    """Gemma's norms scale by 1 + offset: a fresh model's offsets are 0 (a scale of 1)."""
    cfg = load_config(overrides=list(MESHTRON_GEMMA)).model
    model = Transformer(cfg)
    initialize(model, seed=0, std=0.02, num_layers=cfg.num_layers)
    offsets = {n: p for n, p in model.named_parameters() if n.endswith("norm.offset")}
    assert len(offsets) == 4 * 6 + 1  # four around each block, q/k norms, the final norm
    assert all(not p.any() for p in offsets.values())


def test_gemma3_refusals_are_one_line_each():
    base = dict(HF_SHAPE, model_type="gemma3_text", rope_parameters=ROPE)
    refused = {
        "attention cap": (dict(base, attn_logit_softcapping=50.0),
                          "attn_logit_softcapping is not supported"),
        "bidirectional": (dict(base, use_bidirectional_attention=True),
                          "use_bidirectional_attention=true is not supported"),
        "irregular layers": (dict(base, layer_types=["sliding_attention", "full_attention",
                                                     "full_attention"] * 2),
                             "layer_types that are not one full-attention layer after every"),
        "activation": (dict(base, hidden_activation="gelu"), "hidden_activation='gelu'"),
        "local scaling": (dict(base, rope_parameters={**ROPE, "sliding_attention": {
            "rope_type": "linear", "factor": 2.0}}), "on the sliding-window layers"),
        "multimodal": (dict(base, model_type="gemma3"), "Gemma3ForConditionalGeneration"),
        "scalar": (dict(base, query_pre_attn_scalar=0), "'query_pre_attn_scalar' must be"),
    }
    for name, (config, fragment) in refused.items():
        with pytest.raises(MeshtronError) as err:
            hf_model_config(config)
        assert fragment in str(err.value) and "\n" not in str(err.value), name
    exports = {
        "--model.qk_norm=false": "Gemma 3 always normalises queries and keys",
        "--model.qkv_bias=true": "no Hugging Face Gemma 3 equivalent: model.qkv_bias",
        "--model.rope_local_theta=": "model.rope.scaling on its sliding-window layers",
    }
    for override, fragment in exports.items():
        overrides = [o for o in MESHTRON_GEMMA if not o.startswith(override.split("=")[0])]
        if not override.endswith("="):
            overrides.append(override)
        with pytest.raises(MeshtronError, match=fragment):
            hf_format(load_config(overrides=overrides).model)
    bad = {"--model.sliding_window_pattern=0": "model.sliding_window_pattern must be a positive",
           "--model.logit_softcap=-1": "model.logit_softcap must be a positive number"}
    for override, fragment in bad.items():
        with pytest.raises(MeshtronError, match=fragment):
            load_config(overrides=[*MESHTRON_GEMMA, override])
    with pytest.raises(MeshtronError, match="needs model.sliding_window"):
        load_config(overrides=["--model.sliding_window_pattern=6"])


def test_gemma3_with_context_parallelism_is_refused_by_the_plan():
    """cp's attention paths are causal over the whole sequence: a model with windows shorter
    than it is refused before any process starts."""
    from meshtron.plan import check_run

    cfg = load_config(overrides=[*MESHTRON_GEMMA, "--parallel.cp=2", "--train.seq_len=64"])
    with pytest.raises(MeshtronError) as err:
        check_run(cfg, 2)
    assert "model.sliding_window=6 does not combine with parallel.cp=2" in str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- parallel

GEMMA_PARITY = ["--model.arch=gemma3", "--model.qk_norm=true", "--model.num_layers=4",
                "--model.num_kv_heads=1", "--model.head_dim=32", "--model.sliding_window=8",
                "--model.sliding_window_pattern=2", "--model.rope_local_theta=10000",
                "--model.rope_theta=1000000", "--model.query_pre_attn_scalar=24",
                "--model.logit_softcap=30", "--model.tie_embeddings=true"]
"""Local and global layers alternating (both kinds on each of two pipeline stages), one kv
head (fewer than tp: replicated), the window (8) shorter than train.seq_len (32)."""
PARITY_LAYOUTS = [["--parallel.tp=4"], ["--parallel.tp=2", "--parallel.sp=true", "--parallel.pp=2"],
                  ["--parallel.pp=2", "--parallel.zero=2"]]
"""Four ranks each: one kv head on 4 and on 2 tp ranks, sp, pp, dp=2 with ZeRO-2."""
GENERATION_LAYOUTS = ((4, 1), (2, 2))
"""(tp, pp) of the imported model's greedy generation: its kv head replicated over the tp
ranks, its six layers over two stages."""


def train_and_generate(rank: int, world_size: int, cache: str, root: str,
                       layouts: list[list[str]], checkpoint: str) -> tuple[list, dict]:
    """Worker body: every training layout, then greedy generation of the imported model."""
    from meshtron.checkpoint.loading import load_model, open_for_inference
    from meshtron.inference.generate_command import generation_config
    from meshtron.parallel.mesh import MeshLayout, ParallelMesh
    from meshtron.plan import plan_generation
    from tests.parity import run_layouts

    trained = run_layouts(rank, world_size, cache, root, layouts)
    ckpt = open_for_inference(Path(checkpoint))
    generated = {}
    for tp, pp in GENERATION_LAYOUTS:
        cfg = generation_config(ckpt, [f"--parallel.tp={tp}", f"--parallel.pp={pp}"])
        mesh = ParallelMesh(MeshLayout(world_size, tp=tp, pp=pp), rank)
        model = load_model(ckpt, plan_generation(cfg, world_size), mesh, cfg.precision.dtype)
        completions, _ = Generator(model, mesh).generate(PROMPTS, 32)
        generated[(tp, pp)] = [c.tokens for c in completions]
    return trained, generated


@pytest.mark.slow
def test_gemma3_training_and_generation_parity(imported, data_cache, tmp_path):
    """tp (kv heads replicated), sp, pp, dp with ZeRO against one process: per-step loss and
    grad norm, final weights (fp32 to 1e-4, fp64 to 1e-9); the imported model's greedy tokens
    at tp=4 and at tp=2 x pp=2 are the one-process tokens."""
    from tests.distributed import start_distributed
    from tests.parity import assert_layouts_match, layout_references, one_thread

    model, root = imported[1], imported[2]
    layouts = [[*layout, *GEMMA_PARITY] for layout in PARITY_LAYOUTS]
    ranks = start_distributed(train_and_generate, 4, data_cache, str(tmp_path), layouts,
                              str(root / "ckpt"))
    try:  # the one-process runs here while the ranks run
        references = layout_references(layouts, data_cache, tmp_path)
        with one_thread():
            reference = [c.tokens for c in Generator(model).generate(PROMPTS, 32)[0]]
    except BaseException:
        ranks.stop()
        raise
    results = ranks.results()
    assert_layouts_match(layouts, [trained for trained, _ in results], data_cache, tmp_path,
                         references=references)
    for rank, (_, generated) in enumerate(results):
        for layout, tokens_of_layout in generated.items():
            assert tokens_of_layout == reference, f"tp, pp = {layout} (rank {rank})"
