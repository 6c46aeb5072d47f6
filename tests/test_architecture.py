"""The shape of the code itself: declared import layers, no cycles, small modules, one name
per role, documented config fields."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from meshtron.cli import build_parser
from meshtron.config import Config
from meshtron.config.docs import documented_fields, summary, undocumented

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def test_import_layers_and_no_cycles():
    """The contracts in pyproject.toml: the layer order of docs/architecture.md, and no import
    cycle between sibling modules or packages anywhere in meshtron."""
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


@pytest.mark.parametrize("folder", ["meshtron", "benchmarks"])
def test_no_module_is_over_500_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_two_modules_share_a_name():
    """A module's name says its role: two ``pipeline.py`` in different packages would not."""
    names = Counter(p.name for p in (ROOT / "meshtron").rglob("*.py") if p.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []


def test_every_config_field_is_documented():
    sections = [type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)]
    assert [m for section in sections for m in undocumented(section)] == []


def test_train_help_describes_every_field():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    text = train.format_help()
    # a field's line wraps to the terminal: its continuation lines are indented deeper
    joined = re.sub(r"\n {8}(?=\S)", " ", text)
    fields = [line for line in joined.splitlines() if line.startswith("    --")]
    lines = {line.split(" (default")[0].strip(): line for line in fields}
    defaults, count = Config(), 0
    for section in dataclasses.fields(Config):
        for key, _, _, doc in documented_fields(getattr(defaults, section.name), section.name):
            line, first = lines[f"--{key}"], summary(doc)
            assert len(first) > 10 and line.endswith(f": {first}"), line
            count += 1
    assert count == len(lines) > 80


def test_summary_is_the_first_sentence():
    assert summary("Save every this many steps; 0 saves only at the end.") == (
        "Save every this many steps; 0 saves only at the end")
    assert summary("ZeRO stage: 0 replicates state. 1 shards it.\n  More.") == (
        "ZeRO stage: 0 replicates state")
