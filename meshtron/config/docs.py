"""The documentation of config fields, read from the strings under their declarations.

Python keeps no runtime record of an attribute's docstring, so the class source is parsed:
a string expression right after an annotated field documents that field. ``meshtron train
--help`` shows each field's first sentence.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shutil
import textwrap
from collections.abc import Iterator
from functools import cache
from typing import Any

from meshtron.config.sections import config_key


@cache
def field_docs(cls: type) -> dict[str, str]:
    """``{attribute name: its docstring}`` for the fields of dataclass ``cls``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def summary(doc: str) -> str:
    """The first sentence of ``doc`` on one line (a sentence ends at '. ' or the end)."""
    return re.split(r"(?<!\.)\.\s", " ".join(doc.split()), maxsplit=1)[0].rstrip(".")


def documented_fields(section: Any, prefix: str) -> Iterator[tuple[str, str, Any, str]]:
    """(dotted key, attribute name, value, documentation) of every field of the config section
    ``section`` named ``prefix``, nested sections (``model.moe``) walked in place."""
    docs = field_docs(type(section))
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}.{config_key(f.name)}"
        if dataclasses.is_dataclass(value):
            yield from documented_fields(value, key)
        else:
            yield key, f.name, value, docs.get(f.name, "")


def undocumented(cls: type) -> list[str]:
    """Fields of ``cls`` (and of its nested sections) without documentation."""
    docs = field_docs(cls)
    missing = []
    for f in dataclasses.fields(cls):
        if not docs.get(f.name):
            missing.append(f"{cls.__name__}.{f.name}")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            missing += undocumented(type(default))
    return missing


TRAIN_EXAMPLES = """\
examples:
  meshtron train --model.preset=tiny --train.steps=200 --run.dir=runs/tiny
  meshtron train --config configs/default.yaml --train.lr=3e-4
  meshtron train --data.path=corpus.txt --data.vocab_size=4096 --run.dir=runs/mine
  meshtron train --nproc 4 --parallel.tp=2 --parallel.sp=true --run.dir=runs/tp2
  torchrun --nproc-per-node 2 -m meshtron train --parallel.pp=2 --run.dir=runs/pp2"""


def help_width() -> int:
    """Columns help text wraps to: the terminal's (or $COLUMNS) less 2, as argparse's."""
    return max(shutil.get_terminal_size().columns - 2, 40)


def config_reference(width: int | None = None) -> str:
    """Every config field as '--section.field (default ...): what it does', wrapped to
    ``width`` columns (default: the terminal's, as argparse wraps the options above it), then
    examples (kept whole, so that they paste), for `meshtron train --help`."""
    width = width or help_width()
    lines = []
    for line in _reference_lines():
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        lines += textwrap.wrap(line, width, subsequent_indent=indent,
                               break_on_hyphens=False) or [""]
    return "\n".join(lines) + "\n\n" + TRAIN_EXAMPLES


def _reference_lines() -> list[str]:
    """The reference's lines, unwrapped."""
    from meshtron.config import MOE_DEFAULTS, Config

    lines = ["config fields (set in --config YAML or as --section.field=value):"]
    defaults = Config()
    for section in dataclasses.fields(Config):
        values = getattr(defaults, section.name)
        lines.append(f"  {section.name}: {summary(type(values).__doc__)}")
        for key, attr, value, doc in documented_fields(values, section.name):
            if value is None and key.startswith("model.moe."):  # unset: the preset's, or this
                value = MOE_DEFAULTS.get(attr)
            lines.append(f"    --{key} (default {value!r}): {summary(doc)}")
    return lines
