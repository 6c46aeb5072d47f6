"""`meshtron convert` with GGUF files (llama.cpp's format) on either side.

The real model is SmolLM2-135M-Instruct, quantised to Q4_1 (its embedding Q8_0), as installed
by `make setup`; `transformers` loads the same file (its own GGUF reader and dequantiser), so
both sides compute from the same quantised bits. The round trips export a small seeded llama
model with a byte-level BPE tokenizer and read it back with `transformers` and with meshtron.
Bad files are made by rewriting a good one with `gguf.GGUFWriter`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from meshtron.checkpoint.gguf_fields import FastReader
from meshtron.checkpoint.gguf_tensors import from_llama_cpp_order, to_llama_cpp_order
from meshtron.checkpoint.loading import load_for_inference
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.cli import main
from meshtron.config import load_config
from meshtron.data import Tokenizer
from meshtron.data.tokenizer import train_tokenizer
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from tests.real_model import smollm_gguf
from tests.test_hf_convert import SHAPE, cli_error

TEXTS = ("Hello world", "x = 12345 + 3.14", "héllo wörld 日本語 🙂 — ok?",
         "def f(a):\n    return a**2  # square\n", "<|im_start|>user\nHi there<|im_end|>\n",
         "  spaces   and\ttabs\n\n<|endoftext|>", "don't I'LL we've 1,000,000 $5.99")
TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max()).item()


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def transformers():
    """transformers (a test dependency: its GGUF loader is the outside reference)."""
    import transformers

    return transformers


@pytest.fixture(scope="module")
def smollm(smollm_checkpoint):
    """SmolLM2's GGUF imported by `meshtron convert` (the session's import, conftest.py):
    (the import's folder, the GGUF)."""
    return smollm_checkpoint, smollm_gguf()


@pytest.fixture(scope="module")
def smollm_hf(smollm_transformers):
    """transformers' reading of the same file (the session's, conftest.py)."""
    return smollm_transformers


@pytest.mark.slow
def test_real_gguf_logits_equal_transformers(smollm, smollm_hf):
    model, tokenizer = load_for_inference(smollm[0])
    hf, _ = smollm_hf
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris. def f(x): return 2*x")])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert relative(ours, theirs) <= 1e-5  # measured 1.3e-6


@pytest.mark.slow
def test_real_gguf_tokenizer_and_chat_template(smollm, smollm_hf):
    folder, _ = smollm
    _, hf_tokenizer = smollm_hf
    tokenizer = Tokenizer.load(folder / "tokenizer.json")
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.encode("<|im_start|>")[0] == 1  # a control token stays whole
    # tokenizer.ggml.pre=smollm: every numeric character alone, as llama.cpp (and SmolLM2's own
    # tokenizer.json) split; transformers' GGUF tokenizer ignores the name and keeps " ½" whole
    assert tokenizer.encode("a ½²") == tokenizer.encode("a ") + tokenizer.encode("½") + \
        tokenizer.encode("²")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == hf_tokenizer.chat_template
    assert "<|im_start|>" in config["chat_template"]
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    generation = read_model_tensors(next(folder.glob("step_*")))[0].generation
    assert (generation.bos_token_id, generation.eos_token_id) == (1, [2])  # <|im_end|>
    assert not generation.do_sample  # the file names no sampling: greedy, as transformers


# ----------------------------------------------------------------------------- round trips


def bpe_checkpoint(root: Path, *overrides: str) -> tuple[Transformer, Path]:
    """A seeded small llama model whose checkpoint carries a byte-level BPE tokenizer, and a
    tokenizer_config.json with a chat template beside it (as an import leaves one)."""
    cfg = load_config(overrides=[*SHAPE, "--model.num_kv_heads=2", *overrides])
    model = Transformer(cfg.model)
    initialize(model, seed=3, std=0.02, num_layers=cfg.model.num_layers)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a misplaced one shows
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    text = [" ".join(TEXTS) * 3, "the quick brown fox jumps over the lazy dog " * 20]
    tokenizer = train_tokenizer(text, 300, root.parent / "cache", log=lambda _: None)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_model_checkpoint(root, cfg, state, tokenizer=tokenizer.path)
    config = {"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return model.eval(), root


def rounded(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """What a GGUF of ``kind`` keeps of a matrix (vectors are always F32)."""
    if weight.dim() < 2 or kind == "f32":
        return weight
    if kind == "f16":
        return weight.half().float()
    if kind == "bf16":
        return weight.bfloat16().float()
    return weight  # q8_0: checked against its error bound instead


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_export_reads_back_in_transformers_and_meshtron(tmp_path, transformers, kind):
    model, root = bpe_checkpoint(tmp_path / "ckpt")
    out = tmp_path / f"model-{kind}.gguf"
    args = ["convert", "--from", str(root), "--to", str(out), "--format", "gguf"]
    assert main(args + ([] if kind == "f32" else ["--gguf-type", kind])) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    assert main(["convert", "--from", str(out), "--to", str(tmp_path / "back")]) == 0
    back, tokenizer = load_for_inference(tmp_path / "back")
    tokens = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative(back(tokens), hf(tokens).logits) <= 1e-5
        if kind == "f32":
            assert relative(model(tokens), hf(tokens).logits) <= 1e-5
    _, original = read_model_tensors(next(root.glob("step_*")))
    _, weights = read_model_tensors(next((tmp_path / "back").glob("step_*")))
    for name, weight in original.items():
        if kind == "q8_0" and weight.dim() == 2:
            # blocks of 32 rounded to steps of d = max/127, stored as fp16 (2^-11 relative):
            # |error| <= d/2 + 127 * d * 2^-11 = 0.562 d
            blocks = weight.reshape(weight.shape[0], -1, 32).abs().amax(-1, keepdim=True)
            bound = (blocks / 127 * 0.563 + 1e-7).expand(-1, -1, 32).reshape(weight.shape)
            assert bool(((weights[name] - weight).abs() <= bound).all()), name
        else:
            assert torch.equal(weights[name], rounded(weight, kind)), name
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == Tokenizer.load(root / "step_00000000" / "tokenizer.json").encode(text)
    assert hf_tokenizer.chat_template == TEMPLATE
    config = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TEMPLATE and config["eos_token"] == "<|endoftext|>"


@pytest.mark.slow
@pytest.mark.parametrize("overrides,family", [
    (("--model.qkv_bias=true", "--model.hidden_size=512"), "Qwen2ForCausalLM"),
    (("--model.qk_norm=true", "--model.head_dim=128"), "Qwen3ForCausalLM"),
    (("--model.tie_embeddings=true",), "LlamaForCausalLM"),
    (("--model.arch=gpt2", "--model.num_kv_heads=4", "--model.tie_embeddings=false",
      "--model.ffn_hidden_size=256", "--model.max_seq_len=1024"), "GPT2LMHeadModel"),
])  # transformers' GGUF readers assume 128-wide Qwen heads and GPT-2's default ffn and length
def test_families_round_trip(tmp_path, transformers, overrides, family):
    model, root = bpe_checkpoint(tmp_path / "ckpt", *overrides)
    out = tmp_path / "model.gguf"
    assert main(["convert", "--from", str(root), "--to", str(out), "--format", "gguf"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    assert type(hf).__name__ == family
    tokens = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative(model(tokens), hf(tokens).logits) <= 1e-5
    assert main(["convert", "--from", str(out), "--to", str(tmp_path / "back")]) == 0
    back_cfg, back = read_model_tensors(next((tmp_path / "back").glob("step_*")))
    original_cfg, original = read_model_tensors(next(root.glob("step_*")))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    # GGUF keeps the padded vocabulary only (the HF import too, without meshtron's note)
    assert back_cfg.model == dataclasses.replace(original_cfg.model, vocab_size=384)
    sampling = ("do_sample", "temperature", "top_k", "top_p")  # general.sampling.*, both ways
    assert original_cfg.generation.do_sample
    assert [getattr(back_cfg.generation, k) for k in sampling] == \
        [getattr(original_cfg.generation, k) for k in sampling]


def test_llama3_rope_goes_as_llama_cpp_factors_and_back(tmp_path):
    """llama.cpp keeps Llama 3.1's rope scaling as one divisor per frequency (rope_freqs)."""
    rope = ("--model.rope.scaling=llama3", "--model.rope.factor=4",
            "--model.rope.original_max_len=64", "--model.rope.high_freq_factor=8")
    model, root = bpe_checkpoint(tmp_path / "ckpt", *rope)
    out = tmp_path / "model.gguf"
    assert main(["convert", "--from", str(root), "--to", str(out), "--format", "gguf"]) == 0
    stored = next(t for t in gguf.GGUFReader(str(out)).tensors if t.name == "rope_freqs.weight")
    # Llama 3.1's rule for head_dim 16, theta 1e4: wavelengths under 64/8 kept, over 64/1
    # divided by 4, a blend between
    expected = []
    for i in range(8):
        wavelen = 2 * math.pi * 10000 ** (2 * i / 16)
        blend = (64 / wavelen - 1) / (8 - 1)
        expected.append(1.0 if wavelen < 8 else 4.0 if wavelen > 64
                        else 1 / ((1 - blend) / 4 + blend))
    assert np.allclose(stored.data, expected, rtol=1e-6)
    assert main(["convert", "--from", str(out), "--to", str(tmp_path / "back")]) == 0
    back_cfg, _ = read_model_tensors(next((tmp_path / "back").glob("step_*")))
    assert back_cfg.model.rope == read_model_tensors(next(root.glob("step_*")))[0].model.rope
    back, _ = load_for_inference(tmp_path / "back")
    tokens = torch.randint(0, 300, (1, 100), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # positions past the original 64: the scaling matters
        assert torch.equal(back(tokens), model(tokens))


def test_llama_cpp_row_order_is_undone():
    """q/k rows: llama.cpp interleaves each head's two rotary halves; import restores them."""
    heads, width = 2, 8
    rows = torch.arange(heads * width, dtype=torch.float32)[:, None]
    ordered = to_llama_cpp_order(rows, heads)
    # head 0: Hugging Face rows 0..3 pair with 4..7; llama.cpp keeps each pair adjacent
    assert ordered[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(from_llama_cpp_order(ordered, heads), rows)


V = gguf.GGUFValueType
EVERY_VALUE = {  # key: (value, type, element type): each type of the format, alone and in arrays
    **{f"s.{t.name}": (v, t, None) for t, v in [
        (V.UINT8, 200), (V.INT8, -100), (V.UINT16, 60_000), (V.INT16, -30_000),
        (V.UINT32, 4_000_000_000), (V.INT32, -2_000_000_000), (V.FLOAT32, 1e-5),
        (V.UINT64, 2**63 + 5), (V.INT64, -(2**62)), (V.FLOAT64, 1 / 3), (V.BOOL, True),
        (V.STRING, "héllo 日本語 🙂")]},
    **{f"a.{t.name}": (v, V.ARRAY, t) for t, v in [
        (V.UINT8, [0, 255, 7]), (V.INT8, [-128, 127]), (V.UINT16, [65_535, 1]),
        (V.INT16, [-2, 3]), (V.UINT32, [1, 2**32 - 1]), (V.INT32, [-(2**31), 5]),
        (V.FLOAT32, [0.5, -1e-5, 3e38]), (V.UINT64, [2**64 - 1]), (V.INT64, [-1, 2**62]),
        (V.FLOAT64, [1e-300, -2.5]), (V.BOOL, [True, False, True]),
        (V.STRING, ["", "a", "Ġthe", "<|im_end|>", "日本語 🙂", "x" * 1000])]},
    "a.nested": ([[1, 2], [3]], V.ARRAY, V.ARRAY),
}


def write_every_value(path: Path) -> Path:
    """A GGUF file holding :data:`EVERY_VALUE` and one F32 tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype, sub) in EVERY_VALUE.items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_tensor("t.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_fast_reader_reads_every_field_as_the_gguf_package_does(tmp_path):
    """meshtron's reader (metadata arrays a block at a time) against ``gguf.GGUFReader``:
    the same keys, values and types, and the same tensors; a file cut inside a string array
    is refused (the package's reader would return a short array)."""
    path = write_every_value(tmp_path / "every.gguf")
    ours, theirs = FastReader(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert (ours.fields[key].contents(), ours.fields[key].types) == \
            (field.contents(), field.types), key
    for key, (value, _, _) in EVERY_VALUE.items():
        got = ours.fields[key].contents()
        value = [1, 2, 3] if key == "a.nested" else value  # the package flattens nested arrays
        assert got == value or (key.endswith("FLOAT32") and np.allclose(got, value)), key
    assert ours.data_offset == theirs.data_offset
    [mine], [package] = ours.tensors, theirs.tensors
    assert (mine.name, mine.data_offset) == (package.name, package.data_offset)
    assert np.array_equal(mine.data, package.data)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"x" * 1000) + 10])
    with pytest.raises(ValueError, match="runs past the end"):
        FastReader(str(cut))


# ----------------------------------------------------------------------------- bad input


def rewrite(src: Path, dst: Path, meta: dict | None = None, drop: tuple[str, ...] = (),
            tensors: dict | None = None) -> Path:
    """``src`` written again with metadata keys changed (``meta``: key -> value, or None to
    drop it), keys ``drop``ped, and tensors replaced or added (name -> (type, data))."""
    reader = gguf.GGUFReader(str(src))
    arch = (meta or {}).get("general.architecture") or reader.fields["general.architecture"
                                                                     ].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    changes = meta or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        value = changes.pop(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for key, value in changes.items():
        if key != "general.architecture":
            add = {list: writer.add_array, str: writer.add_string}.get(type(value),
                                                                      writer.add_uint32)
            add(key, value)
    replaced = dict(tensors or {})
    for t in reader.tensors:
        qtype, data = replaced.pop(t.name, (t.tensor_type, np.array(t.data)))
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    for name, (qtype, data) in replaced.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    """The F32 export of the small seeded model."""
    folder = tmp_path_factory.mktemp("small")
    bpe_checkpoint(folder / "ckpt")
    out = folder / "model.gguf"
    assert main(["convert", "--from", str(folder / "ckpt"), "--to", str(out),
                 "--format", "gguf"]) == 0
    return out


def _truncated(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


Q = gguf.GGMLQuantizationType
BAD_FILES = {
    "unsupported type": (lambda s, d: rewrite(s, d, tensors={
        "blk.0.ffn_up.weight": (Q.Q8_1, np.zeros((96, 2 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]),
                                                dtype=np.uint8))}),
        "has type Q8_1, which cannot be dequantised"),
    "unknown architecture": (lambda s, d: rewrite(s, d, meta={"general.architecture": "mamba"}),
                             "unsupported architecture 'mamba'"),
    "truncated": (_truncated, "not a readable GGUF file (truncated or damaged"),
    "not gguf": (lambda s, d: d.write_bytes(b"PK\x03\x04 not a model") and d,
                 "not a readable GGUF file"),
    "heads not dividing": (lambda s, d: rewrite(s, d, meta={
        "llama.attention.head_count": 5}, drop=("llama.attention.key_length",)),
        "head_count=5 does not divide llama.embedding_length=64"),
    "shape vs metadata": (lambda s, d: rewrite(s, d, meta={"llama.feed_forward_length": 128}),
                          "has shape (96, 64), its metadata implies (128, 64)"),
    "vocab vs tokens": (lambda s, d: rewrite(s, d, meta={"llama.vocab_size": 999}),
                        "vocab_size=999 disagrees with the 384 tokens"),
    "missing key": (lambda s, d: rewrite(s, d, drop=("llama.block_count",)),
                    "lacks llama.block_count"),
    "rope factors": (lambda s, d: rewrite(s, d, tensors={
        "rope_freqs.weight": (Q.F32, np.ones(8, dtype=np.float32))}),
        "rope_freqs.weight holds per-frequency rope factors that are not Llama 3.1-style"),
    "split file": (lambda s, d: rewrite(s, d, meta={"split.count": 3}),
                   "part 1 of a GGUF split into 3 files"),
    "bad pre-tokenizer": (lambda s, d: rewrite(s, d, meta={"tokenizer.ggml.pre": "klingon"}),
                          "tokenizer.ggml.pre='klingon'"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_gguf_is_one_line_and_writes_nothing(tmp_path, capsys, small_gguf, case):
    make, fragment = BAD_FILES[case]
    bad = make(small_gguf, tmp_path / "bad.gguf")
    line = cli_error(capsys, "convert", "--from", bad, "--to", tmp_path / "o")
    assert fragment in line, line
    assert not (tmp_path / "o").exists()


def sentencepiece_metadata() -> dict:
    """A sentencepiece BPE as llama.cpp stores one (Llama 2, Mistral): <unk>, <s>, </s>, 256
    byte tokens, "▁"-spelled pieces scored by merge order, no merges, unused padding."""
    trained = HFTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    text = [" ".join(TEXTS) * 3, "the quick brown fox jumps over the lazy dog " * 20]
    trained.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    pieces = sorted(trained.get_vocab(), key=trained.get_vocab().get)
    scores = [-float(i) for i in range(len(pieces))]
    # "ΞΨΩ": the pair whose joined token scores higher (ΨΩ) merges first, leaving Ξ + ΨΩ
    pieces += ["Ξ", "Ψ", "Ω", "ΞΨ", "ΨΩ"]
    scores += [-300.0, -300.0, -300.0, 5.0, 10.0]
    pad = 384 - 259 - len(pieces)
    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
                                      *pieces, *(f"[PAD{i}]" for i in range(pad))],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [5] * pad,
            "tokenizer.ggml.scores": [0.0] * 259 + scores + [-1e9] * pad,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1}


@pytest.mark.slow
def test_sentencepiece_tokenizer_equals_transformers(tmp_path, small_gguf, transformers):
    spm = rewrite(small_gguf, tmp_path / "spm.gguf", meta=sentencepiece_metadata(),
                  drop=("tokenizer.ggml.merges", "tokenizer.ggml.pre",
                        "tokenizer.ggml.add_bos_token"))  # unsaid: llama.cpp adds BOS here
    assert main(["convert", "--from", str(spm), "--to", str(tmp_path / "o")]) == 0
    ours = Tokenizer.load(tmp_path / "o" / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=spm.name)
    for text in (*TEXTS, " leading space", "x  y", "ΞΨΩ", "∑ 🚀 ű"):  # ∑ 🚀 ű: byte tokens
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text
    assert [ours.decode([i]) for i in ours.encode("ΞΨΩ")][-2:] == ["Ξ", "ΨΩ"]
    assert ours.encode("🚀") == [ours.token_id("▁")] + [3 + b for b in "🚀".encode()]  # <0xNN>
    assert ours.eos_id == 2 and ours.decode(ours.encode("héllo wörld")) == "héllo wörld"
    config = json.loads((tmp_path / "o" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] and config["bos_token"] == "<s>"
    # exported again (scores from the merge ranks), read by transformers and by meshtron
    again = tmp_path / "again.gguf"
    assert main(["convert", "--from", str(tmp_path / "o"), "--to", str(again),
                 "--format", "gguf"]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=again.name)
    assert main(["convert", "--from", str(again), "--to", str(tmp_path / "back")]) == 0
    back = Tokenizer.load(tmp_path / "back" / "tokenizer.json")
    for text in (*TEXTS, "ΞΨΩ", "∑ 🚀 ű"):
        ids = ours.encode(text)
        assert ids == back.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]


def test_tokenizer_meshtron_cannot_use_is_left_out_with_a_note(tmp_path, capsys, small_gguf):
    """No end-of-text token meshtron knows by name: the model imports, without a tokenizer."""
    tokens = gguf.GGUFReader(str(small_gguf)).fields["tokenizer.ggml.tokens"].contents()
    assert tokens[0] == "<|endoftext|>"
    bad = rewrite(small_gguf, tmp_path / "m.gguf",
                  meta={"tokenizer.ggml.tokens": ["<|stop|>", *tokens[1:]]})
    assert main(["convert", "--from", str(bad), "--to", str(tmp_path / "o")]) == 0
    assert "meshtron cannot use it" in capsys.readouterr().out
    assert not (tmp_path / "o" / "tokenizer.json").exists()
    assert read_model_tensors(next((tmp_path / "o").glob("step_*")))[1]["embed.weight"].shape[0] \
        == 384


def test_bad_export_is_one_line_and_leaves_nothing(tmp_path, capsys, small_gguf, monkeypatch):
    _, root = bpe_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out.gguf"
    cases = [
        (["--format", "gguf", "--gguf-type", "q4_k"], "--gguf-type must be one of"),
        (["--gguf-type", "f16"], "--gguf-type applies only to --format gguf"),
    ]
    for args, fragment in cases:
        line = cli_error(capsys, "convert", "--from", root, "--to", out, *args)
        assert fragment in line, line
    line = cli_error(capsys, "convert", "--from", small_gguf, "--to", out, "--format", "hf")
    assert "converts only to a meshtron checkpoint" in line
    mistral = tmp_path / "mistral"  # a sliding window: Mistral, which GGUF files do not hold
    cfg = load_config(overrides=[*SHAPE, "--model.sliding_window=16"])
    model = Transformer(cfg.model)
    initialize(model, seed=1, std=0.02, num_layers=cfg.model.num_layers)
    write_model_checkpoint(mistral, cfg, {k: v.detach() for k, v in model.state_dict().items()})
    line = cli_error(capsys, "convert", "--from", mistral, "--to", out, "--format", "gguf")
    assert "exports as mistral, which meshtron cannot write as GGUF" in line

    def fail(self):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    line = cli_error(capsys, "convert", "--from", root, "--to", out, "--format", "gguf")
    assert "No space left on device" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "ckpt", "mistral"]
