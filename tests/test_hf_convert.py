"""`meshtron convert`: meshtron checkpoints to and from Hugging Face folders.

Fast tests write HF folders by converting meshtron checkpoints and edit them by hand; the slow
ones build tiny ``transformers`` models locally (nothing is downloaded) and compare logits.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from meshtron.checkpoint.hf_convert import convert, hf_model_config
from meshtron.checkpoint.hf_mapping import hf_shapes, to_hf
from meshtron.checkpoint.loading import load_for_inference
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.cli import main
from meshtron.config import Config, load_config
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer

SHAPE = ("--model.hidden_size=64", "--model.num_heads=4", "--model.ffn_hidden_size=96",
         "--model.num_layers=2", "--model.vocab_size=300", "--model.max_seq_len=128",
         "--train.seq_len=64")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs")


def write_tokenizer(path: Path) -> Path:
    """A small word-level tokenizer.json with meshtron's end-of-text token."""
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def meshtron_checkpoint(root: Path, *overrides: str, tokenizer: bool = False,
                        seed: int = 7) -> tuple[Config, Transformer, Path]:
    """A seeded tiny model written with ``write_model_checkpoint``."""
    cfg = load_config(overrides=[*SHAPE, *overrides])
    model = Transformer(cfg.model)
    initialize(model, seed=seed, std=0.02, num_layers=cfg.model.num_layers)
    tok = write_tokenizer(root.parent / f"{root.name}-tokenizer.json") if tokenizer else None
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return cfg, model.eval(), write_model_checkpoint(root, cfg, state, tokenizer=tok)


def cli_error(capsys, *args: str) -> str:
    """Run ``meshtron`` in-process; assert a non-zero exit and one error line; return it."""
    code = main([str(a) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith("meshtron: error: "), err
    return err[0]


def hf_folder(tmp_path: Path, *overrides: str) -> Path:
    """An HF folder written by meshtron's own exporter (for hand-made corruptions)."""
    _, _, ckpt = meshtron_checkpoint(tmp_path / "ckpt", *overrides)
    convert(ckpt, tmp_path / "hf", "hf")
    return tmp_path / "hf"


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# ----------------------------------------------------------------------------- fast


@pytest.mark.parametrize("overrides", [
    ("--model.num_kv_heads=2",),
    ("--model.arch=gpt2", "--model.tie_embeddings=true"),
])
def test_meshtron_to_hf_to_meshtron_is_identical(tmp_path, overrides):
    cfg, model, ckpt = meshtron_checkpoint(tmp_path / "ckpt", *overrides, tokenizer=True)
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    expected_class = "LlamaForCausalLM" if cfg.model.arch == "llama" else "GPT2LMHeadModel"
    assert config["architectures"] == [expected_class]
    assert config["vocab_size"] == 384  # the padded vocabulary is kept
    assert config["eos_token_id"] == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()

    assert main(["convert", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "back")]) == 0
    back_cfg, back = read_model_tensors(next((tmp_path / "back").glob("step_*")))
    original = read_model_tensors(ckpt)[1]
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    assert back_cfg.model == cfg.model  # vocab_size 300 / multiple 128 come back too
    settings = yaml.safe_load((tmp_path / "back" / "train.yaml").read_text())
    own = str((tmp_path / "back").resolve())  # its checkpoints and its own run directory
    assert settings["checkpoint"]["dir"] == settings["run"]["dir"] == own
    assert Tokenizer.load(tmp_path / "back" / "tokenizer.json").eos_id == 0


SHAPE_CASES = {  # every HF family meshtron exports, tied and untied heads, MoE, MLA, MTP layers
    "llama-gqa": ("--model.num_kv_heads=2",),
    "llama-tied-biases": ("--model.tie_embeddings=true", "--model.qkv_bias=true",
                          "--model.proj_bias=true", "--model.mlp_bias=true",
                          "--model.head_dim=8"),
    "gpt2-tied": ("--model.arch=gpt2", "--model.tie_embeddings=true"),
    "gpt2": ("--model.arch=gpt2", "--model.tie_embeddings=false"),
    "qwen3": ("--model.qk_norm=true", "--model.head_dim=32", "--model.num_kv_heads=2"),
    "mixtral": ("--model.moe.num_experts=4", "--model.moe.top_k=2",
                "--model.moe.expert_ffn_size=32"),
    "qwen3-moe": ("--model.qk_norm=true", "--model.moe.num_experts=4", "--model.moe.top_k=2",
                  "--model.moe.expert_ffn_size=32", "--model.moe.dense_layers=1"),
    "deepseek-mtp": ("--model.preset=tiny-deepseek", "--model.moe.expert_ffn_size=32"),
    "mla": ("--model.preset=tiny-mla",),
    "gemma3": ("--model.arch=gemma3", "--model.qk_norm=true", "--model.num_kv_heads=2",
               "--model.head_dim=32", "--model.sliding_window=6",
               "--model.sliding_window_pattern=2", "--model.rope_local_theta=10000"),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_hf_shapes_are_the_shapes_to_hf_gives(case):
    """The import checks a folder's tensors against ``hf_shapes``, computed from the rules
    without tensor ops: it must be what ``to_hf`` gives a real model's tensors."""
    cfg = load_config(overrides=[*SHAPE, *SHAPE_CASES[case]]).model
    state = {k: v.detach() for k, v in Transformer(cfg).state_dict().items()}
    assert hf_shapes(cfg) == {name: t.shape for name, t in to_hf(state, cfg).items()}


def test_sharded_hf_index_is_read(tmp_path):
    folder = hf_folder(tmp_path, "--model.num_kv_heads=1")
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = convert(folder, tmp_path / "out")
    _, back = read_model_tensors(out.output)
    _, original = read_model_tensors(next((tmp_path / "ckpt").glob("step_*")))
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_hf_vocab_is_kept_exactly():
    base = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for vocab, multiple in ((512, 128), (500, 4), (50257, 1)):
        cfg = hf_model_config({**base, "vocab_size": vocab})
        assert (cfg.vocab_size, cfg.vocab_multiple) == (vocab, multiple)
    mistral = hf_model_config({**base, "model_type": "mistral", "vocab_size": 512,
                               "sliding_window": 128})
    assert mistral.arch == "llama" and mistral.num_kv_heads == 2


def test_pickled_weights_are_refused_without_unpickling(tmp_path, capsys):
    class Payload:
        def __init__(self, marker: Path):
            self.marker = marker

        def __reduce__(self):
            return (open, (str(self.marker), "w"))

    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Payload(probe)))
    assert probe.exists()  # the payload really does run when unpickled

    marker = tmp_path / "unpickled"
    with_config = hf_folder(tmp_path)
    (with_config / "model.safetensors").unlink()
    bare = tmp_path / "bare"
    bare.mkdir()
    for folder in (with_config, bare):
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(marker)))
    for source in (with_config, bare, bare / "pytorch_model.bin"):
        line = cli_error(capsys, "convert", "--from", source, "--to", tmp_path / "out")
        assert "only safetensors are read" in line
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_corrupt_safetensors_is_refused(tmp_path):
    folder = hf_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(MeshtronError, match="cannot read the safetensors weights"):
        convert(folder, tmp_path / "out")


def _missing_tensor(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))


def _wrong_shape(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, str(folder / "model.safetensors"))


def _foreign_tokenizer(folder: Path) -> None:
    """A tokenizer.json of another model: more tokens than the embedding has rows."""
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.add_tokens([f"<extra{i}>" for i in range(rows)])
    tokenizer.save(str(folder / "tokenizer.json"))


HF_BREAKAGES = {
    "unsupported": (lambda f: edit_config(f, model_type="qwen2_moe",
                                          architectures=["Qwen2MoeForCausalLM"]),
                    "unsupported architecture 'qwen2_moe' (its shared expert has a sigmoid gate, "
                    "which meshtron does not compute); meshtron converts DeepSeek-V3, GPT-2, "
                    "Gemma 3, Llama, Mistral, Mixtral, Qwen2, Qwen3 and Qwen3-MoE"),
    "partial rotary": (lambda f: edit_config(f, partial_rotary_factor=0.5),
                       "partial_rotary_factor=0.5 is not supported"),
    "rope scaling": (lambda f: edit_config(f, rope_scaling={"rope_type": "dynamic",
                                                            "factor": 8.0}),
                     "rope scaling 'dynamic' is not supported"),
    "missing tensor": (_missing_tensor, "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
    "wrong shape": (_wrong_shape, "tensor 'model.norm.weight'"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "holds no model.safetensors"),
    "foreign tokenizer": (_foreign_tokenizer, "does not belong to these weights"),
}


@pytest.mark.parametrize("case", list(HF_BREAKAGES))
def test_bad_hf_folder_is_one_clear_line(tmp_path, capsys, case):
    breakage, fragment = HF_BREAKAGES[case]
    folder = hf_folder(tmp_path)
    breakage(folder)
    assert fragment in cli_error(capsys, "convert", "--from", folder, "--to", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_arguments_are_one_clear_line(tmp_path, capsys):
    _, _, ckpt = meshtron_checkpoint(tmp_path / "ckpt")
    empty = tmp_path / "empty"
    empty.mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    cases = [
        (("--from", tmp_path / "nowhere", "--to", tmp_path / "o"), "source not found"),
        (("--from", empty, "--to", tmp_path / "o"), "neither a Hugging Face model folder"),
        (("--from", ckpt, "--to", taken, "--format", "hf"), "exists and is not empty"),
        (("--from", ckpt, "--to", tmp_path / "o", "--format", "onnx"),
         "--format must be one of meshtron, hf"),
        (("--from", tmp_path / "ckpt", "--to", tmp_path / "o"), "already a meshtron checkpoint"),
    ]
    for args, fragment in cases:
        assert fragment in cli_error(capsys, "convert", *args)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("--model.num_kv_heads=2", "--model.rope_theta=500000"),
    ("--model.num_kv_heads=1", "--model.tie_embeddings=true"),
    ("--model.arch=gpt2", "--model.tie_embeddings=true"),
    ("--model.arch=gpt2", "--model.tie_embeddings=false"),
])
def test_exported_model_matches_in_transformers(tmp_path, transformers, overrides):
    cfg, model, ckpt = meshtron_checkpoint(tmp_path / "ckpt", *overrides, tokenizer=True)
    convert(tmp_path / "ckpt", tmp_path / "hf", "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 37),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(model(tokens), hf(tokens).logits) <= 1e-5
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the lazy dog runs"
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.load(ckpt / "tokenizer.json").encode(text)


def build_hf(transformers, kind: str, vocab: int):
    torch.manual_seed(11)
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        config = transformers.LlamaConfig(**shape, rope_theta=50000.0, rms_norm_eps=1e-5)
        return transformers.LlamaForCausalLM(config)
    if kind == "mistral":
        config = transformers.MistralConfig(**shape, sliding_window=None, tie_word_embeddings=True)
        return transformers.MistralForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=128, tie_word_embeddings=False)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
@pytest.mark.parametrize("kind,vocab", [("llama", 500), ("mistral", 512), ("gpt2", 301)])
def test_imported_model_matches_transformers_and_round_trips(tmp_path, capsys, transformers,
                                                             kind, vocab):
    hf = build_hf(transformers, kind, vocab).eval()
    src = tmp_path / "src"
    shard = {"max_shard_size": "40KB"} if kind == "mistral" else {}  # an index and its shards
    hf.save_pretrained(src, safe_serialization=True, **shard)
    write_tokenizer(src / "tokenizer.json")
    assert (src / "model.safetensors.index.json").is_file() == (kind == "mistral")

    assert main(["convert", "--from", str(src), "--to", str(tmp_path / "ckpt")]) == 0
    model, tokenizer = load_for_inference(tmp_path / "ckpt")
    tokens = torch.randint(0, vocab, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_diff(model(tokens), hf(tokens).logits) <= 1e-5
    assert tokenizer.eos_id == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "the",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the")

    convert(tmp_path / "ckpt", tmp_path / "back", "hf")
    original = {}
    for file in sorted(src.glob("*.safetensors")):
        original.update(load_file(file))
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["vocab_size"] == vocab
