"""Chat data (``data.format=chat``): the model's template rendered as transformers renders it,
the answers' loss weights, packing, and bad records refused with their file and line."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.data.chat import ChatEncoder, pack_records, uses_chat
from meshtron.data.chat_template import ChatTemplate, find_chat_template
from meshtron.data.tokenizer import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh import ParallelMesh
from tests.chat_data import (
    TEMPLATES,
    chat_tokenizer,
    conversation,
    transformers_tokenizer,
    write_conversations,
)
from tests.parity import test_overrides


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {family: chat_tokenizer(root / family, family) for family in TEMPLATES}


def encoder(path: Path, include_prompt: bool = False) -> ChatEncoder:
    return ChatEncoder(Tokenizer.load(path), find_chat_template(path), include_prompt)


def ids_of(encoded: np.ndarray) -> list[int]:
    return [int(i) for i in np.where(encoded < 0, -encoded - 1, encoded)]


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_tokens_equal_transformers_apply_chat_template(tokenizers, family):
    """The same ids as transformers' apply_chat_template(tokenize=True), then end-of-text."""
    path = tokenizers[family]
    enc, hf = encoder(path), transformers_tokenizer(path, family)
    r = random.Random(3)
    for i in range(6):
        messages = conversation(r)
        got = ids_of(enc.encode(messages, f"x:{i}"))
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert got == list(want) + [enc.tokenizer.eos_id], (family, messages)
        prompt = enc.template.render(messages[:-1], add_generation_prompt=True)
        assert prompt == hf.apply_chat_template(messages[:-1], tokenize=False,
                                                add_generation_prompt=True)


def test_answer_weights_equal_transformers_generation_mask(tokenizers):
    """Prefix rendering finds exactly what a {% generation %} block marks."""
    path = tokenizers["chatml"]
    enc, hf = encoder(path), transformers_tokenizer(path, "chatml")
    r = random.Random(4)
    for i in range(6):
        messages = conversation(r)
        got = (enc.encode(messages, f"x:{i}") >= 0)[:-1]
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)["assistant_masks"]
        assert got.tolist() == [bool(w) for w in want]


@pytest.mark.parametrize("family,end", [("smollm2", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_only_answers_and_their_end_of_turn_carry_loss(tokenizers, family, end):
    enc = encoder(tokenizers[family])
    messages = [{"role": "user", "content": "What is one plus two?"},
                {"role": "assistant", "content": "It is three."},
                {"role": "user", "content": "And twice that?"},
                {"role": "assistant", "content": "6 ☃"}]
    encoded = enc.encode(messages, "x:1")
    assert enc.tokenizer.decode(encoded[encoded >= 0]) == f"It is three.{end}6 ☃{end}"
    everything = encoder(tokenizers[family], include_prompt=True).encode(messages, "x:1")
    assert (everything[1:] >= 0).all() and everything[0] < 0  # a record's first: never
    assert ids_of(everything) == ids_of(encoded)


def test_records_are_packed_whole_and_read_as_documents(tokenizers):
    enc = encoder(tokenizers["smollm2"])
    r = random.Random(5)
    records = [(f"f:{i}", enc.encode(conversation(r), f"f:{i}")) for i in range(12)]
    size, eos = 256, enc.tokenizer.eos_id
    packed = pack_records(records, size, eos, truncate=False)
    assert packed.windows.shape[1] == size and packed.used == sum(len(t) for _, t in records)
    flat = [w.tolist() for w in packed.windows]
    for _, tokens in records:  # each record lies whole inside one window
        assert sum(_contains(w, tokens.tolist()) for w in flat) >= 1
    mb = SequenceSplit(ParallelMesh.single().cp, document_mask=True, eos_id=eos)(
        torch.from_numpy(packed.windows))
    assert (mb.tokens >= 0).all() and ((mb.targets >= 0) | (mb.targets == -1)).all()
    a, b = len(records[0][1]), len(records[1][1])  # the first two records open window 0
    assert a + b <= size and packed.windows[0, :a].tolist() == records[0][1].tolist()
    documents = mb.sequence.documents[0].tolist()
    assert documents[:a] == [0] * a and documents[a:a + b] == [1] * b
    assert mb.targets[0, a - 1] == -1  # a record's first token is never predicted
    longest = max(len(t) for _, t in records)
    with pytest.raises(MeshtronError, match=r"f:\d+: the conversation is \d+ tokens, more"):
        pack_records(records, longest - 1, eos, truncate=False)
    cut = pack_records(records, longest - 1, eos, truncate=True)
    assert cut.truncated >= 1 and cut.windows.shape[1] == longest - 1


def _contains(window: list[int], tokens: list[int]) -> bool:
    n = len(tokens)
    return any(window[i:i + n] == tokens for i in range(len(window) - n + 1))


@pytest.mark.parametrize("source,message", [
    ("{{ messages[0]['content'] + 1 }}", "x:7: the chat template (t.jinja) failed to render"),
    ("{{ ''.__class__.__mro__ }}", "x:7: the chat template (t.jinja) failed to render"),
    ("{% for m in messages %}", "the chat template of t.jinja is not valid jinja (line 1"),
])
def test_a_template_that_fails_is_one_line(tokenizers, source, message):
    """Its own Python errors and the sandbox's refusals too, not only raise_exception."""
    enc = encoder(tokenizers["smollm2"])
    enc.template = ChatTemplate(source, "t.jinja")
    with pytest.raises(MeshtronError, match=re.escape(message)):
        enc.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                   "x:7")


def test_chat_jsonl_is_detected(tmp_path):
    chat = write_conversations(tmp_path / "chat.jsonl", 3)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    cfg = load_config(overrides=[f"--data.path={chat}"])
    assert uses_chat(cfg.data)
    assert not uses_chat(load_config(overrides=[f"--data.path={text}"]).data)
    assert not uses_chat(load_config(overrides=[f"--data.path={chat}",
                                                "--data.format=text"]).data)


BAD = [
    ('{"messages": [{"role": "user", "content": "hi"}]', "line 3: not JSON"),
    ('{"text": "hi"}', 'line 3: a record needs "messages"'),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "line 3: message 0 has the unknown "
     "role 'robot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 3: the conversation has no "
     "assistant turn"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, '
     '{"role": "assistant", "content": "c"}]}', "line 3: the chat template"),
]


@pytest.mark.parametrize("line,message", BAD)
def test_a_bad_record_is_one_line_with_its_file_and_line(tokenizers, data_cache, tmp_path,
                                                         capsys, line, message):
    """Refused before anything is written (the llama3 template raises on a late system)."""
    data = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": conversation(random.Random(0))})
    data.write_text(f"{good}\n\n{line}\n{good}\n")
    run = tmp_path / "run"
    args = ["train", *test_overrides(data_cache, str(run)), f"--data.path={data}",
            "--data.format=chat", f"--data.tokenizer={tokenizers['llama3']}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{data}:{message.split(': ', 1)[0].split()[-1]}" in err
    assert message.split(": ", 1)[1] in err
    assert not run.exists()


@pytest.mark.slow
def test_the_real_smollm2_template_gives_transformers_ids(smollm_checkpoint, smollm_transformers):
    """SmolLM2-135M-Instruct imported from its GGUF: the template meshtron convert kept beside
    the tokenizer is the file's, and its ids are those transformers' GGUF tokenizer gives."""
    _, hf = smollm_transformers
    path = Path(smollm_checkpoint) / "tokenizer.json"
    enc = encoder(path)
    assert enc.template.source == hf.chat_template
    r = random.Random(6)
    for i in range(6):
        messages = conversation(r)
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert ids_of(enc.encode(messages, f"x:{i}")) == list(want) + [enc.tokenizer.eos_id]


@pytest.mark.parametrize("setting", ["--train.eval_generate=8", "--model.mtp_depth=1"])
def test_what_chat_data_does_not_combine_with_is_one_line(tokenizers, data_cache, tmp_path,
                                                          capsys, setting):
    data = write_conversations(tmp_path / "chat.jsonl", 4)
    args = ["train", *test_overrides(data_cache, str(tmp_path / "run")), f"--data.path={data}",
            f"--data.tokenizer={tokenizers['smollm2']}", "--train.eval_every=1", setting]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"does not combine with {setting[2:-2]} yet" in err
