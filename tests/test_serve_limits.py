"""The server does not stall on one large or odd request (issue 51): bodies and prompts are
bounded in bytes before they are parsed or tokenised (413 / 400), prompts are tokenised off the
event loop so ``/health`` answers meanwhile, and a lone surrogate or JSON nested 100,000 deep
is a 400, not a 500. In process: the app over a real (untrained) tiny model and the test
corpus's tokenizer, driven through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest

from meshtron.config import load_config
from meshtron.data import Tokenizer
from meshtron.inference.completion_api import Limits, RequestError, parse_request
from meshtron.inference.engine import Engine
from meshtron.inference.server import build_app, longest_token_bytes
from meshtron.models.generation import Generator
from meshtron.models.transformer import WHOLE_MODEL, Transformer
from meshtron.parallel.mesh import ParallelMesh
from tests.parity import test_overrides


class HeldTokenizer(Tokenizer):
    """The real tokenizer, whose ``encode`` waits until the test lets it go: a request held
    in preparation for as long as the test looks at the server."""

    def __init__(self, real: Tokenizer):
        super().__init__(real._hf, real.path, real.fingerprint)
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30)
        return super().encode(text)


@pytest.fixture(scope="module")
def served(data_cache, tmp_path_factory):
    """(engine, tokenizer) for a 2-layer model of the test config, untrained."""
    tokenizer = Tokenizer.load(next(Path(data_cache).glob("tokenizers/*/tokenizer.json")))
    overrides = test_overrides(data_cache, str(tmp_path_factory.mktemp("serve") / "run"))
    cfg = load_config(overrides=[*overrides, f"--model.vocab_size={tokenizer.vocab_size}"])
    mesh = ParallelMesh.single()
    engine = Engine(Generator(Transformer(cfg.model, mesh, WHOLE_MODEL).eval(), mesh),
                    tokenizer, max_batch=4)
    engine.start()
    yield engine, tokenizer
    engine.close()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_health_answers_while_a_request_is_tokenised(served):
    engine, real = served
    held = HeldTokenizer(real)
    app = build_app(engine, held, "tiny")

    async def scenario() -> tuple[int, int, dict]:
        async with client(app) as http:
            pending = asyncio.create_task(http.post(
                "/v1/completions", json={"prompt": "def f", "max_tokens": 2,
                                         "temperature": 0}))
            assert await asyncio.to_thread(held.entered.wait, 30)
            health = await asyncio.wait_for(http.get("/health"), 10)  # stalled: times out
            held.release.set()
            done = await asyncio.wait_for(pending, 60)
            return health.status_code, done.status_code, done.json()

    health, status, body = asyncio.run(scenario())
    assert health == 200 and status == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert held.threads and "MainThread" not in held.threads  # not on the event loop's thread


def test_a_body_past_the_limit_is_413_before_it_is_read(served):
    engine, tokenizer = served
    app = build_app(engine, tokenizer, "tiny")
    limits = Limits.of(engine.max_len, longest_token_bytes(tokenizer))
    huge = json.dumps({"prompt": "x" * (limits.body_bytes + 1)}).encode()

    async def chunks():
        yield huge[: len(huge) // 2]
        yield huge[len(huge) // 2:]

    async def scenario() -> list[httpx.Response]:
        async with client(app) as http:
            whole = await http.post("/v1/completions", content=huge,
                                    headers={"content-type": "application/json"})
            streamed = await http.post("/v1/completions", content=chunks())  # no length
            long_prompt = await http.post("/v1/completions", json={
                "prompt": "y" * (limits.prompt_bytes + 1)})
            return [whole, streamed, long_prompt]

    whole, streamed, long_prompt = asyncio.run(scenario())
    for response in (whole, streamed):
        assert response.status_code == 413, response.text
        assert f"over {limits.body_bytes:,} bytes" in response.json()["error"]["message"]
    assert long_prompt.status_code == 400
    assert "more than the model's positions can hold" in long_prompt.json()["error"]["message"]


def test_the_prompt_limit_is_never_below_what_fits(served):
    engine, tokenizer = served
    limits = Limits.of(engine.max_len, longest_token_bytes(tokenizer))
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.decode([i])))
    text = tokenizer.decode([longest]) * (engine.max_len - 1)  # as long as fitting text gets
    limits.check_prompts([text])
    assert len(text.encode()) <= limits.prompt_bytes


@pytest.mark.parametrize(("body", "message"), [
    (b'{"prompt": "\\ud800"}', r"the prompt holds a lone surrogate \(\\ud800 at character 1\)"),
    (b'{"prompt": ["ok", "a\\udfff"]}', r"prompt 2 holds a lone surrogate \(\\udfff at"),
    (b'{"prompt": "x", "stop": "\\ud800"}', "a stop string holds a lone surrogate"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
])
def test_a_lone_surrogate_or_deep_nesting_is_a_400(body, message):
    with pytest.raises(RequestError, match=message) as err:
        parse_request(body)
    assert err.value.status == 400


def test_the_app_answers_400_not_500_for_them(served):
    engine, tokenizer = served
    app = build_app(engine, tokenizer, "tiny")

    async def post(body: bytes) -> httpx.Response:
        async with client(app) as http:
            return await http.post("/v1/completions", content=body)

    for body in (b'{"prompt": "\\ud800"}', b'{"prompt": ' + b"[" * 100_000 + b"}"):
        response = asyncio.run(post(body))
        assert response.status_code == 400, response.text
