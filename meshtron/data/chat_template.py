"""A model's own chat template: found beside its tokenizer and rendered with jinja2 as
``transformers``' ``apply_chat_template`` renders it.

A chat template is jinja code shipped with the model (``chat_template.jinja``, the
``chat_template`` of ``tokenizer_config.json``, or the GGUF key ``tokenizer.chat_template``,
which ``meshtron convert`` copies into ``tokenizer_config.json``). Rendering it with the same
environment transformers builds (sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text, the special
tokens as variables, a ``{% generation %}`` block) gives the same text, so the same token ids,
as the model saw in its own fine-tuning: a hand-written formatter would drift from it.

Templates come from model files and are untrusted code: jinja's sandbox refuses attribute
access to Python internals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshtron.errors import MeshtronError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The ``tokenizer_config.json`` entries a template may read as variables."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks what the assistant generates in
    templates written for assistant masks; its body renders unchanged (meshtron finds the
    answers by rendering prefixes, see :mod:`meshtron.data.chat`)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """jinja's own ``tojson`` escapes HTML characters; templates expect plain JSON."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str, where: str) -> jinja2.Template:
    """``source`` compiled in the sandboxed environment transformers renders templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise MeshtronError(f"the chat template of {where} is not valid jinja (line "
                            f"{err.lineno}: {err.message})") from None


class TemplateFailed(ValueError):
    """A chat template failed to render a conversation (its message)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it reads."""

    source: str
    where: str
    """Where it came from (said in errors)."""
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The conversation as text. A template that fails on it (``raise_exception``, a
        sandbox refusal, an undefined name it calls, a Python error of its own code such as
        adding a number to a string) raises :class:`TemplateFailed` with its message."""
        try:
            return self.compiled.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except Exception as err:  # noqa: BLE001 - the template is code from the model's files
            raise TemplateFailed(str(err) or type(err).__name__) from None

    @cached_property
    def compiled(self) -> jinja2.Template:
        return compile_template(self.source, self.where)


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MeshtronError(f"cannot read {path} ({err})") from None
    if not isinstance(data, dict):
        raise MeshtronError(f"{path} is not a JSON object")
    return data


def _named_template(value: Any, where: Path) -> str | None:
    """``chat_template`` is a string, or a list of {name, template} of which 'default' is used."""
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise MeshtronError(f"{where}: chat_template is neither a string nor a list holding one "
                        "named 'default'")


def _template_file(path: Path, tokens: dict[str, str]) -> ChatTemplate:
    try:
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), tokens)
    except (OSError, UnicodeDecodeError) as err:
        raise MeshtronError(f"cannot read chat template {path} ({err})") from None


def find_chat_template(tokenizer_path: Path, override: str | None = None) -> ChatTemplate:
    """The chat template of the tokenizer at ``tokenizer_path`` (its ``tokenizer.json``):
    ``override`` (a .jinja file) if given, else ``chat_template.jinja`` beside it, else the
    ``chat_template`` of ``tokenizer_config.json`` beside it; the special tokens always come
    from ``tokenizer_config.json`` when there is one."""
    folder = tokenizer_path.parent
    config_path = folder / CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    tokens = {name: text for name in SPECIAL_TOKENS
              if (text := _token_text(config.get(name))) is not None}
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise MeshtronError(f"data.chat.template {override} not found")
        return _template_file(path, tokens)
    if (folder / TEMPLATE_FILE).is_file():
        return _template_file(folder / TEMPLATE_FILE, tokens)
    source = _named_template(config.get("chat_template"), config_path)
    if source is None:
        raise MeshtronError(
            f"the tokenizer {tokenizer_path} has no chat template (no {TEMPLATE_FILE}, no "
            f"chat_template in a {CONFIG_FILE} beside it); set data.chat.template to a .jinja file")
    return ChatTemplate(source, str(config_path), tokens)
