"""The OpenAI chat completions API as ``meshtron serve`` speaks it (``POST
/v1/chat/completions``): ``messages`` rendered with the model's chat template and its
generation prompt, then generated like a completion; the response and stream-chunk bodies
clients of that API expect.

The other fields (max_tokens, temperature, top_p, top_k, stop, stream, seed, ...) mean what
they mean for completions and are checked by the same code
(:func:`~.completion_api.parse_request`). Plain Python, no web framework.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace

from meshtron.data.chat_template import ChatTemplate, TemplateFailed
from meshtron.inference.completion_api import (
    FIELDS,
    OPENAI_SAMPLING,
    CompletionRequest,
    RequestError,
    parse_request,
)
from meshtron.models.generation import Sampling

ROLES = ("system", "user", "assistant")
CHAT_FIELDS = tuple(f for f in FIELDS if f not in ("prompt", "echo", "suffix", "best_of",
                                                   "logprobs")) + ("messages",)
"""Fields a chat request may hold (the completion fields, ``messages`` for ``prompt``)."""


def parse_chat_request(body: bytes, template: ChatTemplate | None,
                       defaults: Sampling = OPENAI_SAMPLING) -> CompletionRequest:
    """The request in ``body`` as a completion of one prompt: its ``messages`` rendered by
    ``template`` with the generation prompt, every other field checked as for completions."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = [key for key in data if key not in CHAT_FIELDS]
    if unknown:
        raise RequestError(f"unsupported field {unknown[0]!r} in a chat request (it takes "
                           f"{', '.join(CHAT_FIELDS[-1:] + CHAT_FIELDS[:9])})", unknown[0])
    messages = check_messages(data.pop("messages", None))
    if template is None:
        raise RequestError("this model has no chat template (none beside its tokenizer or "
                           "its training data's); use /v1/completions", status=404)
    try:
        prompt = template.render(messages, add_generation_prompt=True)
    except TemplateFailed as err:
        raise RequestError(f"the model's chat template refused these messages: {err}",
                           "messages") from None
    req = parse_request(json.dumps({**data, "prompt": prompt}).encode(), defaults)
    return replace(req, prompts=[prompt])


def check_messages(messages: object) -> list[dict[str, str]]:
    """``messages``: a non-empty list of {role, content} with known roles and string content."""
    if not isinstance(messages, list) or not messages:
        raise RequestError('the request needs "messages", a non-empty list of {"role", '
                           '"content"} objects', "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise RequestError(f'message {i} needs a "role" and a string "content"', "messages")
        if message.get("role") not in ROLES:
            raise RequestError(f"message {i} has the unknown role {message.get('role')!r} "
                               f"(known: {', '.join(ROLES)})", "messages")
        out.append({"role": message["role"], "content": message["content"]})
    return out


@dataclass(frozen=True)
class ChatReply:
    """What every body of one chat response shares."""

    model: str
    id: str
    created: int

    @classmethod
    def new(cls, model: str) -> ChatReply:
        return cls(model, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))

    def head(self, chunk: bool) -> dict:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str | None, usage: dict) -> dict:
        """The response body of a request that did not stream."""
        return {**self.head(False), "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish}], "usage": usage}

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        """One stream chunk: the first says the role, the next carry content, the last its
        ``finish_reason`` with an empty delta."""
        return {**self.head(True), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}]}
