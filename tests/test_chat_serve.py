"""``meshtron serve``'s ``POST /v1/chat/completions`` on a model fine-tuned on conversations:
the messages rendered with the model's template and generation prompt are completed exactly
as ``/v1/completions`` completes that text, whole or streamed in OpenAI's chunk shape; bad
requests are a 4xx with a message."""

from __future__ import annotations

import pytest

from meshtron.data.chat_template import find_chat_template
from meshtron.data.tokenizer import Tokenizer
from tests.chat_data import chat_tokenizer, write_conversations
from tests.parity import run_training, test_overrides
from tests.test_serve import Server, complete, events, request

MESSAGES = [{"role": "system", "content": "Answer in words."},
            {"role": "user", "content": "What is two plus three?"}]


@pytest.fixture(scope="module")
def chat_run(data_cache, tmp_path_factory) -> tuple[str, str]:
    """A tiny model trained 2 steps on conversations; (run dir, its tokenizer.json)."""
    root = tmp_path_factory.mktemp("chat-serve")
    tokenizer = str(chat_tokenizer(root / "tok", "chatml", vocab=512))
    data = write_conversations(root / "chat.jsonl", 40)
    run = str(root / "run")
    run_training(test_overrides(data_cache, run, steps=2) + [
        f"--data.path={data}", f"--data.tokenizer={tokenizer}", "--train.seq_len=256",
        "--model.max_seq_len=320"])
    return run, tokenizer


@pytest.fixture(scope="module")
def chat_server(chat_run, tmp_path_factory):
    server = Server(chat_run[0], tmp_path_factory.mktemp("chat-serve-log") / "stderr.txt")
    yield server
    code, log = server.stop()
    assert code == 130 and "chat: template from" in log


def chat(url: str, **body) -> tuple[int, dict | str]:
    return request(f"{url}/v1/chat/completions", body)


def test_a_chat_completion_completes_the_rendered_conversation(chat_server, chat_run):
    path = chat_run[1]
    prompt = find_chat_template(Tokenizer.load(path).path).render(MESSAGES, True)
    assert prompt.endswith("<|im_start|>assistant\n")
    status, answer = chat(chat_server.url, messages=MESSAGES, max_tokens=6, temperature=0)
    plain = complete(chat_server.url, prompt=prompt, max_tokens=6, temperature=0)
    assert status == 200 and answer["object"] == "chat.completion", answer
    (one,) = answer["choices"]
    assert one["message"] == {"role": "assistant", "content": plain["choices"][0]["text"]}
    assert one["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert answer["usage"] == plain["usage"]
    assert answer["usage"]["prompt_tokens"] == len(Tokenizer.load(path).encode(prompt))


def test_a_streamed_chat_completion_sends_the_same_text_in_chunks(chat_server):
    status, whole = chat(chat_server.url, messages=MESSAGES, max_tokens=6, temperature=0)
    status, stream = chat(chat_server.url, messages=MESSAGES, max_tokens=6, temperature=0,
                          stream=True)
    assert status == 200
    got = events(stream)
    assert got[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in got[:-1])
    deltas = [e["choices"][0]["delta"] for e in got[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert "".join(d.get("content", "") for d in deltas) == \
        whole["choices"][0]["message"]["content"]
    assert got[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize("body,message", [
    ({"max_tokens": 2}, 'the request needs "messages"'),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
    ({"messages": MESSAGES, "prompt": "x"}, "unsupported field 'prompt'"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature must be >= 0"),
])
def test_a_bad_chat_request_is_a_400_with_a_message(chat_server, body, message):
    status, answer = chat(chat_server.url, **body)
    assert status == 400 and message in answer["error"]["message"], answer
    assert chat(chat_server.url, messages=MESSAGES, max_tokens=1)[0] == 200
