"""A GGUF file's tokenizer metadata to and from a Hugging Face ``tokenizer.json``.

A GGUF has no ``tokenizer.json``: llama.cpp stores a byte-level BPE (``tokenizer.ggml.model``
``gpt2``) as its tokens in GPT-2's byte spelling, its merges, a type per token (normal,
control, user-defined, unused) and the *name* of the rule that splits text before the merges
(``tokenizer.ggml.pre``). :data:`PRE_TOKENIZERS` is that name's meaning as a ``tokenizers``
pre-tokenizer, used both ways: an import builds it, an export finds the name whose
pre-tokenizer equals the one in ``tokenizer.json``. Control tokens become special added tokens
and user-defined ones plain added tokens, so text naming them (``<|im_start|>``) encodes to
their ids, as llama.cpp encodes it. A sentencepiece BPE (``llama``: Llama 2, Mistral) is
converted too, its merges ranked by the tokens' scores (llama.cpp's rule); other models
(unigram ``t5``, ...) are not: the import says so and writes the model without one. The export
writes both kinds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from meshtron.errors import MeshtronError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""llama.cpp's token types (``gguf.TokenType``)."""
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    """GPT-2's split (its regex is the ByteLevel pre-tokenizer's own)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    """Every digit alone, then GPT-2's split (StarCoder, SmolLM)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(regex: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return build


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    # the first name of each rule is the one an export writes
    "gpt-2": _gpt2, "default": _gpt2, "mpt": _gpt2, "olmo": _gpt2,
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2, "refact": _digits_then_gpt2,
    "command-r": _digits_then_gpt2, "codeshell": _digits_then_gpt2,
    "llama-bpe": _split(LLAMA3_SPLIT), "llama3": _split(LLAMA3_SPLIT),
    "llama-v3": _split(LLAMA3_SPLIT), "falcon3": _split(LLAMA3_SPLIT),
    "dbrx": _split(LLAMA3_SPLIT), "smaug-bpe": _split(LLAMA3_SPLIT),
    "qwen2": _split(QWEN2_SPLIT), "deepseek-r1-qwen": _split(QWEN2_SPLIT),
}
"""``tokenizer.ggml.pre`` -> the split llama.cpp makes for it (llama.cpp's llama-vocab.cpp)."""


def byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the others for
    the characters from U+0100 on, so every byte string is a printable string."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _strings(meta: dict[str, Any], key: str, where: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MeshtronError(f"{where}: {key} must be a list of strings")
    return value


def tokenizer_from_gguf(meta: dict[str, Any], where: str) -> tuple[HFTokenizer | None, str]:
    """The tokenizer a GGUF file's metadata describes, or None and why it is not converted."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        return None, (f"{where} has tokenizer.ggml.model={kind!r}; only byte-level BPE (gpt2) "
                      "and sentencepiece BPE (llama) tokenizers are converted, so none was "
                      "written (give one with --data.tokenizer)")
    tokens = _strings(meta, "tokenizer.ggml.tokens", where)
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens):
        raise MeshtronError(f"{where}: tokenizer.ggml.token_type does not give one type per "
                            "token")
    build = _byte_level if kind == "gpt2" else _sentencepiece
    try:
        tokenizer, whole = build(meta, tokens, where)
    except MeshtronError:
        raise
    except Exception as err:  # the Rust side raises plain Exceptions
        raise MeshtronError(f"{where}: the tokenizer metadata is inconsistent "
                            f"({str(err).splitlines()[0][:120]})") from None
    kept = [(t, kind) for t, kind in zip(tokens, types) if whole(t)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in kept if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in kept if kind == USER_DEFINED])
    return tokenizer, ""


def _byte_level(meta: dict[str, Any], tokens: list[str], where: str
                ) -> tuple[HFTokenizer, Callable[[str], bool]]:
    """GPT-2-style BPE: the file's merges and split rule; tokens spelled in GPT-2's byte
    alphabet (a token outside it, which llama.cpp mislabels, is respelled and not added whole)."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise MeshtronError(f"{where}: tokenizer.ggml.pre={str(pre)[:80]!r} is a pre-tokenizer "
                            f"meshtron does not know (it knows {', '.join(PRE_TOKENIZERS)})")
    merges = [tuple(m.split(" ")) for m in _strings(meta, "tokenizer.ggml.merges", where)]
    if any(len(m) != 2 for m in merges):
        raise MeshtronError(f"{where}: tokenizer.ggml.merges holds an entry that is not two "
                            "tokens separated by one space")
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, lambda t: set(t) <= alphabet


def _sentencepiece(meta: dict[str, Any], tokens: list[str], where: str
                   ) -> tuple[HFTokenizer, Callable[[str], bool]]:
    """SentencePiece BPE (Llama 2, Mistral): spaces as "▁", one prepended to the text, bytes
    without a token as ``<0xNN>`` tokens. llama.cpp merges the adjacent pair whose joined token
    scores highest; a BPE whose merge ranks follow those scores does the same."""
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise MeshtronError(f"{where}: tokenizer.ggml.scores does not give one score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for index, (token, score) in enumerate(zip(tokens, scores)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, -len(left), -len(right), index, vocab[left],
                               vocab[right], left, right))
    ranked = [(m[-2], m[-1]) for m in sorted(merges)]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=ranked, fuse_unk=True,
                                       byte_fallback=True))
    tokenizer.pre_tokenizer, tokenizer.decoder = _sentencepiece_parts()
    return tokenizer, lambda t: True


def _sentencepiece_parts() -> tuple[pre_tokenizers.PreTokenizer, decoders.Decoder]:
    """The pre-tokenizer (one "▁" prepended, spaces as "▁") and decoder of a sentencepiece
    BPE, as the import builds them and the export recognises them."""
    return (pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False),
            decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                               decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)]))


def special_token(meta: dict[str, Any], key: str, where: str) -> str | None:
    """The text of the token ``tokenizer.ggml.{key}`` names (None if the file names none)."""
    token_id = meta.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
        raise MeshtronError(f"{where}: tokenizer.ggml.{key}={token_id} is not a token id of its "
                            f"{len(tokens)} tokens")
    return tokens[token_id]


def tokenizer_config(meta: dict[str, Any], where: str, max_len: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of the file's tokenizer: special tokens, BOS/EOS
    insertion flags and the chat template."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "model_max_length": max_len}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        config[name] = special_token(meta, key, where)
    sentencepiece = meta.get("tokenizer.ggml.model") == "llama"  # llama.cpp adds BOS there
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


# ----------------------------------------------------------------------------- export


def _pre_name(pre_tokenizer: Any) -> str | None:
    """The GGUF name of a ``tokenizer.json`` pre-tokenizer (None when llama.cpp has none)."""
    for name, build in PRE_TOKENIZERS.items():
        if json.loads(build().__getstate__()) == pre_tokenizer:
            return name
    return None


def gguf_tokenizer_metadata(tokenizer_json: str, vocab_rows: int
                            ) -> tuple[dict[str, Any] | None, str]:
    """``tokenizer.ggml.*`` metadata of a byte-level BPE (model, pre, tokens, types, merges)
    or sentencepiece BPE (tokens, types, scores) ``tokenizer.json`` with ``vocab_rows`` tokens
    (padding rows named ``[PADi]``, unused), or None and why it cannot be written."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    decoder = data.get("decoder") or {}
    if model.get("type") != "BPE" or data.get("normalizer") is not None:
        return None, "the tokenizer is not a BPE without a normalizer, which is all GGUF holds"
    pre_tokenizer, spm_decoder = _sentencepiece_parts()
    if (data.get("pre_tokenizer") == json.loads(pre_tokenizer.__getstate__())
            and decoder == json.loads(spm_decoder.__getstate__()) and model.get("byte_fallback")):
        return _sentencepiece_metadata(data, vocab_rows), ""
    if decoder.get("type") != "ByteLevel":
        return None, "the tokenizer is neither a byte-level nor a sentencepiece BPE"
    pre = _pre_name(data.get("pre_tokenizer"))
    if pre is None:
        return None, ("the tokenizer's pre-tokenizer is none of llama.cpp's "
                      f"({', '.join(PRE_TOKENIZERS)})")
    tokens, types = _token_table(data, vocab_rows)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges}, ""


def _sentencepiece_metadata(data: dict[str, Any], vocab_rows: int) -> dict[str, Any]:
    """A sentencepiece BPE as llama.cpp stores it: scores instead of merges, each token
    scored by the rank of the first merge that makes it (so the import ranks them the same),
    tokens no merge makes below them all; ``<0xNN>`` tokens typed as bytes."""
    tokens, types = _token_table(data, vocab_rows)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in data["model"].get("merges", [])]
    first: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
    scores = [-float(first.get(token, len(merges) + 1)) for token in tokens]
    for index, token in enumerate(tokens):
        if types[index] == NORMAL and _BYTE_TOKEN.fullmatch(token):
            types[index] = BYTE
        if token == "<unk>" and types[index] == NORMAL:
            types[index] = UNKNOWN
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.add_space_prefix": True}


def _token_table(data: dict[str, Any], vocab_rows: int) -> tuple[list[str], list[int]]:
    """(token, type) for each of ``vocab_rows`` ids: the vocabulary, added tokens as control
    (special) or user-defined, unused padding rows as ``[PADi]``."""
    model = data["model"]
    tokens: list[str | None] = [None] * vocab_rows
    types = [NORMAL] * vocab_rows
    for token, index in model["vocab"].items():
        if index < vocab_rows:
            tokens[index] = token
    for added in data.get("added_tokens", []):
        if added["id"] < vocab_rows:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    for index, token in enumerate(tokens):
        if token is None:
            tokens[index], types[index] = f"[PAD{index}]", UNUSED
    return [str(t) for t in tokens], types
