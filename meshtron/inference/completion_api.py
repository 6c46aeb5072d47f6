"""The OpenAI completions API as ``meshtron serve`` speaks it: a request body checked field by
field (every problem one :class:`RequestError`, answered with HTTP 4xx and a message, never a
traceback), and the response and stream-chunk bodies clients of that API expect.

Plain Python (no web framework), so the rules can be read and tested on their own.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from meshtron.models.generation import Sampling

DEFAULT_MAX_TOKENS = 16
"""The OpenAI API's default for ``max_tokens``."""
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None,
           "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}
"""Fields of the OpenAI API that this server accepts only at their neutral value."""
FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream",
          "stream_options", "seed", "user", *NEUTRAL)


class RequestError(ValueError):
    """A request the server cannot run: the HTTP status and one line saying why."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    """``stream_options.include_usage``: a last chunk with the token counts."""


OPENAI_SAMPLING = Sampling(1.0, 0, 1.0)
"""The OpenAI API's own defaults (temperature 1, no top-k, top_p 1)."""


def parse_request(body: bytes, defaults: Sampling = OPENAI_SAMPLING) -> CompletionRequest:
    """The request in ``body`` (JSON), every field checked; ``defaults`` (the server's: the
    model's generation settings under its flags) for temperature, top_k and top_p left out."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply (a completion request is "
                           "a flat JSON object)") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = [key for key in data if key not in FIELDS]
    if unknown:
        raise RequestError(f"unsupported field {unknown[0]!r} (this server takes "
                           f"{', '.join(FIELDS[:10])})", unknown[0])
    for key, neutral in NEUTRAL.items():
        if data.get(key, neutral) not in (neutral, {}):
            raise RequestError(f"{key}={json.dumps(data[key])} is not supported by meshtron "
                               f"serve (only {json.dumps(neutral)})", key)
    if "prompt" not in data:
        raise RequestError("the request needs a prompt (a string or a list of strings)",
                           "prompt")
    prompt = data["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
        raise RequestError("prompt must be a string or a non-empty list of strings", "prompt")
    for i, text in enumerate(prompts):
        _check_text(text, f"prompt {i + 1}" if len(prompts) > 1 else "the prompt", "prompt")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError('stream_options takes only {"include_usage": true|false}',
                           "stream_options")
    temperature = _number(data, "temperature", defaults.temperature)
    top_p = _number(data, "top_p", defaults.top_p)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0 (0 is greedy), got {temperature}",
                           "temperature")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must lie in (0, 1] (1 disables it), got {top_p}", "top_p")
    seed = _integer(data, "seed", None, minimum=-(2**63))
    if seed is not None and seed >= 2**64:
        raise RequestError(f"seed must fit in 64 bits, got {seed}", "seed")
    sampling = Sampling(temperature, _integer(data, "top_k", defaults.top_k), top_p)
    return CompletionRequest(
        prompts, _integer(data, "max_tokens", DEFAULT_MAX_TOKENS), sampling, seed,
        _stops(data.get("stop")), _flag(data, "stream"), _flag(options, "include_usage"))


def check_fits(encoded: list[list[int]], max_tokens: int, max_len: int) -> None:
    """Each prompt and ``max_tokens`` new tokens fit the model's positions."""
    for i, tokens in enumerate(encoded):
        used = max(len(tokens), 1)  # an empty prompt starts from EOS
        if used + max(max_tokens, 1) > max_len:
            which = f"prompt {i + 1}" if len(encoded) > 1 else "the prompt"
            raise RequestError(f"{which} takes {used} tokens and max_tokens is {max_tokens}: "
                               f"the model has {max_len} positions, so prompt + max_tokens "
                               f"must be at most {max_len}", "prompt")


def _integer(data: dict, key: str, default: int | None, minimum: int = 0) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"{key} must be an integer >= {minimum}, got {json.dumps(value)}",
                           key)
    return value


def _number(data: dict, key: str, default: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{key} must be a number, got {json.dumps(value)}", key)
    return float(value)


def _flag(data: dict, key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {json.dumps(value)}", key)
    return value


def _stops(value: object) -> tuple[str, ...]:
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    for text in stops:
        _check_text(text, "a stop string", "stop")
    return tuple(stops)


def _check_text(text: str, what: str, param: str) -> None:
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``): Python keeps it in the string,
    but it is no character, and neither UTF-8 nor a tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"{what} holds a lone surrogate (\\u{ord(text[err.start]):04x} at "
                           f"character {err.start + 1}), which is not text", param) from None


@dataclass(frozen=True)
class Limits:
    """Bytes a request may have, checked before it is parsed or tokenised, so that one huge
    request cannot hold the server: a prompt past ``prompt_bytes`` cannot fit the model's
    positions whatever its tokens (no token covers more than ``token_bytes`` of text), and the
    body may hold a few such prompts with JSON's escapes."""

    prompt_bytes: int
    body_bytes: int

    @classmethod
    def of(cls, max_len: int, token_bytes: int) -> Limits:
        """``max_len`` positions, no token longer than ``token_bytes`` bytes (doubled, with a
        kilobyte to spare, for what a tokenizer's normaliser and prefix space may add)."""
        prompt = 2 * max_len * max(token_bytes, 1) + 1024
        return cls(prompt, max(2**20, 8 * prompt))

    def check_prompts(self, prompts: list[str]) -> None:
        """A 400 for a prompt that cannot fit, before tokenising it."""
        for i, text in enumerate(prompts):
            size = len(text.encode("utf-8"))
            if size > self.prompt_bytes:
                which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
                raise RequestError(f"{which} is {size:,} bytes: more than the model's positions "
                                   f"can hold (at most {self.prompt_bytes:,} bytes)", "prompt")


def too_large(size: int, limits: Limits) -> RequestError:
    """The 413 answer to a body over ``limits.body_bytes``."""
    return RequestError(f"the request body is over {limits.body_bytes:,} bytes ({size:,} or "
                        "more); send fewer or shorter prompts", status=413)


def error_body(err: RequestError) -> dict:
    """The OpenAI API's error object."""
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return {"error": {"message": str(err), "type": kind, "param": err.param, "code": None}}


@dataclass(frozen=True)
class Reply:
    """What every body of one response shares."""

    model: str
    id: str
    created: int

    @classmethod
    def new(cls, model: str) -> Reply:
        return cls(model, f"cmpl-{uuid.uuid4().hex}", int(time.time()))

    def head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model}


def choice(index: int, text: str, finish: str | None) -> dict:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(body: dict | str) -> str:
    """One server-sent event: ``data: {...}`` and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
