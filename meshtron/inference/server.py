"""The HTTP face of ``meshtron serve``: a FastAPI app with ``POST /v1/completions`` (the OpenAI
completions API, whole or streamed as server-sent events), ``POST /v1/chat/completions`` (the
chat API: messages rendered with the model's chat template, :mod:`.chat_api`), ``GET
/v1/models`` and ``GET /health``.

Handlers run on uvicorn's event loop and never generate: they read the body (bounded in bytes:
a 413 past :class:`~.completion_api.Limits`), check the request and encode its prompts in a
worker thread (so that ``/health`` and other requests are answered meanwhile), queue one engine
job per prompt and wait for the engine thread's reports, which come back onto the loop through
``call_soon_threadsafe``. A bad request is a 4xx answer with the OpenAI API's error object; the
server goes on.

FastAPI is imported by the command only when it serves (an optional dependency).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from meshtron.data import Tokenizer
from meshtron.data.chat_template import ChatTemplate
from meshtron.inference.chat_api import ChatReply, parse_chat_request
from meshtron.inference.completion_api import (
    OPENAI_SAMPLING,
    CompletionRequest,
    Limits,
    Reply,
    RequestError,
    check_fits,
    choice,
    error_body,
    parse_request,
    sse,
    too_large,
    usage,
)
from meshtron.inference.engine import Engine, EngineClosed, Job, Progress
from meshtron.models.generation import Sampling

Prepared = tuple[CompletionRequest, list[list[int]]]
"""A request checked and its prompts tokenised (done off the event loop)."""

Event = tuple[int, Progress | BaseException]
"""A report for prompt ``index`` of a request."""


def build_app(engine: Engine, tokenizer: Tokenizer, model_name: str,
              on_ready: Callable[[], None] = lambda: None,
              defaults: Sampling = OPENAI_SAMPLING,
              chat_template: ChatTemplate | None = None) -> FastAPI:
    """The app serving ``engine``'s model under ``model_name``; ``on_ready`` is called once
    uvicorn has started it; ``defaults`` is the sampling of a request that sets none;
    ``chat_template`` renders chat requests' messages (None: chat requests get a 404)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        on_ready()
        yield

    app = FastAPI(title="meshtron", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": str(engine.error)}, 503)
        return JSONResponse({"status": "ok", "model": model_name, "waiting": engine.waiting,
                             "batches": engine.batches})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "meshtron"}]}

    limits = Limits.of(engine.max_len, longest_token_bytes(tokenizer))

    def prepare(body: bytes, parse: Callable[[bytes], CompletionRequest]) -> Prepared:
        """The request ``parse`` reads from ``body``, checked, and its tokens (run in a worker
        thread)."""
        req = parse(body)
        limits.check_prompts(req.prompts)
        encoded = [tokenizer.encode(p) for p in req.prompts]
        check_fits(encoded, req.max_tokens, engine.max_len)
        return req, encoded

    def submit(req: CompletionRequest, encoded: list[list[int]]) -> asyncio.Queue[Event]:
        """One engine job per prompt; their reports arrive on the returned queue."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue[Event]()

        def reporter(index: int) -> Callable[[Progress | BaseException], None]:
            def report(progress: Progress | BaseException) -> None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                    loop.call_soon_threadsafe(events.put_nowait, (index, progress))
            return report

        engine.submit([Job(tokens, req.max_tokens, req.sampling, req.seed, req.stops,
                           reporter(i)) for i, tokens in enumerate(encoded)])
        return events

    async def accept(request: Request, parse: Callable[[bytes], CompletionRequest]
                     ) -> tuple[CompletionRequest, list[list[int]], asyncio.Queue[Event]] \
            | JSONResponse:
        """The request read, prepared off the event loop and submitted; or its error reply."""
        try:
            body = await read_body(request, limits)
            req, encoded = await asyncio.to_thread(prepare, body, parse)
            return req, encoded, submit(req, encoded)
        except RequestError as err:
            return JSONResponse(error_body(err), err.status)
        except EngineClosed as err:
            return JSONResponse(error_body(RequestError(str(err), status=503)), 503)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        accepted = await accept(request, lambda body: parse_request(body, defaults))
        if isinstance(accepted, JSONResponse):
            return accepted
        req, encoded, events = accepted
        reply = Reply.new(model_name)
        prompt_tokens = sum(len(tokens) for tokens in encoded)
        if req.stream:
            return StreamingResponse(_stream(reply, req, events, prompt_tokens),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(reply, len(encoded), events, prompt_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        accepted = await accept(  # its messages rendered with the model's template
            request, lambda body: parse_chat_request(body, chat_template, defaults))
        if isinstance(accepted, JSONResponse):
            return accepted
        req, encoded, events = accepted
        reply, prompt_tokens = ChatReply.new(model_name), len(encoded[0])
        if req.stream:
            return StreamingResponse(_chat_stream(reply, req, events, prompt_tokens),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _chat_whole(reply, events, prompt_tokens)

    return app


async def read_body(request: Request, limits: Limits) -> bytes:
    """The request body, refused (413) as soon as it is known to pass ``limits.body_bytes``:
    from its Content-Length, else while it streams in."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.body_bytes:
        raise too_large(int(declared), limits)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.body_bytes:
            raise too_large(size, limits)
        chunks.append(chunk)
    return b"".join(chunks)


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes any one token decodes to (the bound of :class:`Limits`)."""
    return max(len(tokenizer.decode([i]).encode("utf-8", "replace"))
               for i in range(tokenizer.vocab_size))


async def _whole(reply: Reply, count: int, events: asyncio.Queue[Event],
                 prompt_tokens: int) -> Response:
    """Wait for every prompt's end; one response body."""
    texts, finishes, tokens = [""] * count, [None] * count, [0] * count
    while any(finish is None for finish in finishes):
        index, progress = await events.get()
        if isinstance(progress, BaseException):
            return _failure(progress)
        texts[index] += progress.text
        finishes[index], tokens[index] = progress.finish, progress.tokens
    body = {**reply.head(), "choices": [choice(i, texts[i], finishes[i]) for i in range(count)],
            "usage": usage(prompt_tokens, sum(tokens))}
    return JSONResponse(body)


async def _stream(reply: Reply, req: CompletionRequest, events: asyncio.Queue[Event],
                  prompt_tokens: int) -> AsyncIterator[str]:
    """Server-sent events: a chunk per new piece of text of any prompt, the last one of each
    with its ``finish_reason``, then ``data: [DONE]``."""
    left, tokens = len(req.prompts), [0] * len(req.prompts)
    while left:
        index, progress = await events.get()
        if isinstance(progress, BaseException):
            yield sse(_failure_body(progress))
            return
        tokens[index] = progress.tokens
        left -= progress.finish is not None
        yield sse({**reply.head(), "choices": [choice(index, progress.text, progress.finish)]})
    if req.include_usage:
        yield sse({**reply.head(), "choices": [], "usage": usage(prompt_tokens, sum(tokens))})
    yield sse("[DONE]")


async def _chat_whole(reply: ChatReply, events: asyncio.Queue[Event],
                      prompt_tokens: int) -> Response:
    """Wait for the answer's end; one ``chat.completion`` body."""
    text, finish, tokens = "", None, 0
    while finish is None:
        _, progress = await events.get()
        if isinstance(progress, BaseException):
            return _failure(progress)
        text += progress.text
        finish, tokens = progress.finish, progress.tokens
    return JSONResponse(reply.whole(text, finish, usage(prompt_tokens, tokens)))


async def _chat_stream(reply: ChatReply, req: CompletionRequest, events: asyncio.Queue[Event],
                       prompt_tokens: int) -> AsyncIterator[str]:
    """Server-sent ``chat.completion.chunk`` events: the role, a delta per new piece of text,
    an empty delta with the ``finish_reason``, then ``data: [DONE]``."""
    yield sse(reply.chunk({"role": "assistant", "content": ""}))
    finish, tokens = None, 0
    while finish is None:
        _, progress = await events.get()
        if isinstance(progress, BaseException):
            yield sse(_failure_body(progress))
            return
        finish, tokens = progress.finish, progress.tokens
        if progress.text:
            yield sse(reply.chunk({"content": progress.text}))
    yield sse(reply.chunk({}, finish))
    if req.include_usage:
        yield sse({**reply.head(True), "choices": [], "usage": usage(prompt_tokens, tokens)})
    yield sse("[DONE]")


def _failure_body(err: BaseException) -> dict:
    status = 503 if isinstance(err, EngineClosed) else 500
    message = str(err) if isinstance(err, EngineClosed) else \
        f"generation failed ({type(err).__name__}: {err}); the server is stopping"
    return error_body(RequestError(message, status=status))


def _failure(err: BaseException) -> Response:
    body = _failure_body(err)
    return JSONResponse(body, 503 if isinstance(err, EngineClosed) else 500)
