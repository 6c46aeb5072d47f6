"""Building a config: defaults, then a YAML file, then ``--section.field=value`` overrides.

Each name is checked (unknown sections and keys get a close-match suggestion) and each value is
coerced to its annotated type; :func:`resolve` then fills what was left unset from the model
preset, so the written ``config.yaml`` states every value used, and
:func:`~meshtron.config.checks.validate` checks each field. Checks that relate sections to each
other or to a world size belong to the run plan (:mod:`meshtron.plan`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from meshtron.config.checks import suggest, validate
from meshtron.config.presets import MODEL_PRESETS
from meshtron.config.rope_section import RopeConfig
from meshtron.config.sections import (
    MOE_DEFAULTS,
    SECTIONS,
    Config,
    DataConfig,
    TrainConfig,
    attribute_name,
    config_key,
)
from meshtron.config.vision_section import VISION_DEFAULTS
from meshtron.errors import MeshtronError


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML- or CLI-parsed value to the annotated type, or explain why not."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], where)
        for option in inner:  # the first alternative that takes the value (int | float)
            with contextlib.suppress(MeshtronError):
                return _coerce(value, option, where)
        raise MeshtronError(f"{where}: expected {' or '.join(map(_type_name, inner))}, got "
                            f"{value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = split_list(value)
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, item_tp, where) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):  # not a number: the error below
                return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):  # not a number: the error below
                return float(value)
    elif tp is str and isinstance(value, bool):  # YAML 1.1 reads off/no/false as False
        return "on" if value else "off"
    elif tp is str and isinstance(value, (str, int, float)):
        return str(value)
    raise MeshtronError(f"{where}: expected {_type_name(tp)}, got {value!r}")


@functools.cache
def _field_types(section_type: type) -> dict[str, Any]:
    """A config section class's fields by config key, with their resolved types (resolving the
    annotations costs about 0.5 ms a field; configs are loaded many times per process). The
    returned mapping is shared: read it, never change it."""
    return {config_key(k): v for k, v in typing.get_type_hints(section_type).items()}


def _set_field(cfg: Any, section: str, key: str, value: Any) -> None:
    """Set ``section.key`` of ``cfg``; ``key`` may be dotted into a nested section
    (``model.moe.top_k``), and a mapping value sets a nested section field by field."""
    known = hasattr(cfg, attribute_name(section))
    if not known or not dataclasses.is_dataclass(getattr(cfg, section)):
        raise MeshtronError(f"unknown config section '{section}'{suggest(section, SECTIONS)}")
    sec_obj = getattr(cfg, section)
    hints = _field_types(type(sec_obj))
    head, _, rest = key.partition(".")
    if head not in hints:
        raise MeshtronError(
            f"unknown config key '{section}.{key}'" + _suggest_dotted(section, head, hints)
        )
    nested = dataclasses.is_dataclass(hints[head])
    if nested and rest:
        try:
            return _set_field(sec_obj, head, rest, value)
        except MeshtronError as err:
            raise MeshtronError(str(err).replace(f"'{head}.", f"'{section}.{head}.")) from None
    if nested and isinstance(value, dict):
        for sub_key, sub_value in value.items():
            _set_field(cfg, section, f"{head}.{sub_key}", sub_value)
        return
    if nested or rest:
        raise MeshtronError(f"config key '{section}.{key}' does not name a field")
    setattr(sec_obj, attribute_name(key), _coerce(value, hints[key], f"{section}.{key}"))


def _suggest_dotted(section: str, key: str, hints: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(hints), n=1)
    return f" (did you mean '{section}.{close[0]}'?)" if close else ""


def _apply_mapping(cfg: Config, data: Any, source: str) -> None:
    if data is None:
        return
    if not isinstance(data, dict):
        raise MeshtronError(f"{source}: expected a mapping of config sections at the top level")
    for section, values in data.items():
        if section not in SECTIONS:
            raise MeshtronError(
                f"{source}: unknown config section '{section}'{suggest(str(section), SECTIONS)}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise MeshtronError(f"{source}: section '{section}' must be a mapping of fields")
        for key, value in values.items():
            try:
                _set_field(cfg, section, str(key), value)
            except MeshtronError as err:
                raise MeshtronError(f"{source}: {err}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.field=value`` (leading dashes allowed) into its parts."""
    body = text.lstrip("-")
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise MeshtronError(f"override '{text}' must look like --section.field=value")
    name, raw = body.split("=", 1)
    section, key = name.split(".", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        raise MeshtronError(f"override --{name} is nested too deeply") from None
    return section, key, value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file, then overrides; resolved and validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        check_config_file(p)
        try:
            data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
        except UnicodeDecodeError:
            raise MeshtronError(f"{p}: not a text file (a config is UTF-8 YAML)") from None
        except RecursionError:
            raise MeshtronError(f"{p} is nested too deeply") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None)
            detail = f": {problem}" if problem and "given twice" in problem else ""
            raise MeshtronError(f"{p}: not valid YAML{where}{detail}") from None
        _apply_mapping(cfg, data, str(p))
    for text in overrides:
        section, key, value = parse_override(text)
        _set_field(cfg, section, key, value)
    resolve(cfg)
    validate(cfg)
    return cfg


class OnceAction(argparse.Action):
    """An option that may be given once: a second ``--config`` used to replace the first
    without a word. Two files are refused rather than merged, since a merge would have to pick
    a rule (whole sections or single fields) the user cannot see; overrides on the command
    line are the documented way to change a file's values."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None:
            raise argparse.ArgumentError(self, f"given twice ({earlier}, then {values}); give "
                                         "one file and change its values with "
                                         "--section.field=value")
        setattr(namespace, self.dest, values)


def check_config_file(path: Path) -> None:
    """``path`` is a regular file: a FIFO would block the read forever and a device such as
    /dev/zero would fill memory, and "not found" would be the wrong reason for either."""
    try:
        exists = path.exists()
    except OSError as err:  # a name too long, a parent that is a file
        raise MeshtronError(f"config file {str(path)[:80]!r} cannot be read: "
                            f"{err.strerror}") from None
    if not exists:
        raise MeshtronError(f"config file not found: {path}")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file (a pipe or a device)"
        raise MeshtronError(f"config file {path} is {kind}; give a YAML file")


def split_list(text: str) -> list[str]:
    """A comma-separated list from the command line; ``\\,`` is a comma inside an item (a file
    named ``a,b.txt`` is ``--data.path=a\\,b.txt``; in YAML, a list needs no escaping)."""
    items = re.split(r"(?<!\\),", text)
    return [item.replace("\\,", ",") for item in items if item]


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last
    silently, so half of a config would be ignored without a word). Merge keys (``<<: *base``)
    work as in YAML 1.1: the mapping's own keys override the merged ones."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # flattened by SafeConstructor below
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a resolved config (for example one stored in a checkpoint)."""
    cfg = Config()
    _apply_mapping(cfg, data, "config")
    resolve(cfg)
    validate(cfg)
    return cfg


def _resolve_vision_window(cfg: Config) -> None:
    """A vision model's training window is one observation (image patches, instruction, the
    readout token and actions): train.seq_len follows from model.vision, and a different
    explicit value is an error rather than silently replaced (the default is replaced)."""
    window = cfg.model.vision.seq_len
    given = cfg.train.seq_len
    if given not in (window, TrainConfig().seq_len):
        raise MeshtronError(f"train.seq_len={given}, but a vision model's window is {window} "
                            "tokens (image patches + instruction + readout token + action "
                            "tokens - 1, from model.vision); leave train.seq_len unset")
    cfg.train.seq_len = window


def resolve(cfg: Config) -> None:
    """Fill unset model fields from the preset; everything else keeps its explicit value."""
    m = cfg.model
    if m.preset not in MODEL_PRESETS:
        raise MeshtronError(
            f"unknown model.preset '{m.preset}'{suggest(m.preset, MODEL_PRESETS)}; "
            f"choose one of {', '.join(MODEL_PRESETS)}"
        )
    for key, value in MODEL_PRESETS[m.preset].items():
        if key in ("moe", "vision", "rope"):
            continue
        if getattr(m, key) is None:
            setattr(m, key, value)
    for key, value in {**MOE_DEFAULTS, **MODEL_PRESETS[m.preset].get("moe", {})}.items():
        if getattr(m.moe, key) is None:
            setattr(m.moe, key, value)
    for key, value in {**VISION_DEFAULTS, **MODEL_PRESETS[m.preset].get("vision", {})}.items():
        if getattr(m.vision, key) is None:
            setattr(m.vision, key, value)
    plain = RopeConfig()  # a rope field still at its default takes the preset's value
    for key, value in MODEL_PRESETS[m.preset].get("rope", {}).items():
        if getattr(m.rope, key) == getattr(plain, key):
            setattr(m.rope, key, value)
    if m.moe.expert_ffn_size is None:
        m.moe.expert_ffn_size = m.ffn_hidden_size
    if m.num_kv_heads is None:
        m.num_kv_heads = m.num_heads
    if m.rope_theta is None:
        m.rope_theta = 10000.0
    if m.norm_eps is None:
        m.norm_eps = 1e-5
    if m.tie_embeddings is None:
        m.tie_embeddings = False
    if m.mtp_depth is None:
        m.mtp_depth = 0
    if m.vision.enabled:
        _resolve_vision_window(cfg)
    if cfg.data.cache_dir == DataConfig.cache_dir:
        cfg.data.cache_dir = default_cache_dir()
    if cfg.data.path is not None:
        paths = [p for p in cfg.data.path if p]
        if not paths:
            raise MeshtronError("data.path is empty; name a file, folder or dataset prefix, or "
                                "leave data.path unset for the built-in corpus")
        cfg.data.path = paths


def default_cache_dir() -> str:
    """Where caches go unless data.cache_dir says: ``$XDG_CACHE_HOME/meshtron`` when that is
    set to an absolute path (the XDG base-directory rule), else ``~/.cache/meshtron``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return os.path.join(xdg, "meshtron") if os.path.isabs(xdg) else DataConfig.cache_dir


def split_overrides(extra: list[str]) -> list[str]:
    """Command-line overrides as ``--section.field=value``: accepts ``--a.b=v`` and
    ``--a.b v``; refuses anything else with a clear message."""
    overrides, i = [], 0
    while i < len(extra):
        arg = extra[i]
        name = arg.lstrip("-").split("=", 1)[0]
        if not arg.startswith("--") or "." not in name:
            raise MeshtronError(f"unrecognised argument '{arg}' (overrides look like "
                                "--section.field=value)")
        if "=" in arg:
            overrides.append(arg)
            i += 1
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            overrides.append(f"{arg}={extra[i + 1]}")
            i += 2
        else:
            raise MeshtronError(f"override '{arg}' needs a value: {arg}=VALUE")
    return overrides
