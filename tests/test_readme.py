"""The README's commands, then the docs', run as a newcomer would: in order, in one fresh
working directory (the docs' after the README's, whose runs and files they use).

Each command runs as written, but shorter: step counts (``--train.steps``,
``checkpoint.every``, ``checkpoint.resume_from`` and those in ``--config`` files) are divided
by 100 (at most 3), a command that names no step count trains one step, an evaluation takes
one batch, sequences are at most 1024 tokens long, a run from released weights trains on 2
sequences, and every run reads a 1 MB slice of the built-in corpus from a private cache.
``meshtron`` is this environment's (activating it,
``. .venv/bin/activate``, is what this test's Python already is), and ``cp`` copies from it
(``.venv/`` is ``sys.prefix``). ``meshtron sample-data`` writes 1 MB instead of 4,
``meshtron archsearch`` trains 3 proxies (as long as the budget makes them) and refines one,
``hpsearch`` runs 3 trials and ``evaluate`` 4 episodes. ``make test`` is not run (it is this
suite), and ``make train`` runs what the Makefile runs. The docs' commands are those of
their ``bash`` and ``sh`` blocks; the few not run here are in :data:`DOCS_NOT_RUN`, each with
its reason.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.distributed import run_python as forked_python
from tests.readme_docs import DOCS_NOT_RUN, docs_commands, not_run_reason
from tests.test_cli import _JOB_VARIABLES

pytestmark = pytest.mark.xdist_group("readme")
"""The commands run in order in one working directory: under ``pytest -n`` they stay on one
worker."""

ROOT = Path(__file__).resolve().parent.parent
SCALED = ("--train.steps", "--checkpoint.every", "--checkpoint.resume_from",
          "--train.eval_every", "--train.log_every")
MAX_SEQ_LEN = 1024
ARCHSEARCH_SHORT = ("--proxies", "3", "--refine", "1")
FEWER = {"--trials": "3", "--episodes": "4"}
"""Counts of other commands' units of work (hpsearch trials, evaluate's episodes), set small."""
YAML_SCALED = {("train", "steps"), ("checkpoint", "every"), ("train", "eval_every"),
               ("train", "log_every")}
RELEASED_BATCH = "--train.global_batch=2"
"""A run from released weights (``--config`` naming the ``train.yaml`` that ``meshtron convert``
wrote) trains on 2 sequences instead of 8: its step and its evaluation batch are a real model's
(135M parameters), 20 of the README run's 53 CPU-seconds at 8."""


def readme_commands(text: str, languages: str = "bash") -> list[list[str]]:
    """Every command of the ``bash`` (or ``languages``, a regex) blocks of a markdown text, as
    argument lists (comments dropped, continued lines joined)."""
    commands = []
    for block in re.findall(rf"```(?:{languages})\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def scaled(value: str) -> str:
    """A step count divided by 100, between 1 and 3."""
    return str(min(3, max(1, int(value) // 100))) if value.isdigit() else value


def shortened(words: list[str], cwd: Path, cache: Path) -> list[str]:
    """``words`` with the step counts divided by 100 and the corpus made small."""
    out = [f"{w.split('=', 1)[0]}={scaled(w.split('=', 1)[1])}"
           if w.split("=", 1)[0] in SCALED and "=" in w else w for w in words]
    out = [f"--train.seq_len={min(int(w.split('=')[1]), MAX_SEQ_LEN)}"
           if w.startswith("--train.seq_len=") else w for w in out]
    train = out.index("train")
    inserted = [f"--data.cache_dir={cache}", "--data.corpus_max_mb=1", "--run.progress=false",
                "--train.eval_batches=1"]
    if "--config" in out:
        saved = yaml.safe_load((cwd / out[out.index("--config") + 1]).read_text()) or {}
        inserted += [f"--{section}.{key}={scaled(str(saved[section][key]))}"
                     for section, key in sorted(YAML_SCALED) if key in saved.get(section, {})]
    if not any(w.startswith("--train.steps=") for w in out + inserted):
        inserted.append("--train.steps=1")
    if "--config" in out and out[out.index("--config") + 1].endswith("/train.yaml") and not any(
            w.startswith("--train.global_batch=") for w in out):
        inserted.append(RELEASED_BATCH)
    return out[: train + 1] + inserted + out[train + 1 :]


def argv(words: list[str], cwd: Path, cache: Path) -> list[list[str]] | None:
    """The meshtron argument lists a README command stands for (None: not run here)."""
    if words == ["make", "test"]:
        return None
    if words == ["make", "train"]:  # what the Makefile's train target runs
        return [["-m", "meshtron", *shortened(["train", "--config", "configs/default.yaml"],
                                               cwd, cache)],
                ["-m", "meshtron", "generate", "--checkpoint", "runs/default", "--prompt", "def ",
                 "--max-new-tokens", "20"]]
    if words == [".", ".venv/bin/activate"]:  # this test's Python is the environment's
        return None
    if words[0] == "printf":  # a file the next command reads, written by the shell
        return [["-c", "import subprocess, sys; subprocess.run(sys.argv[1], shell=True, "
                 "check=True)", shlex.join(words[:-2]) + " > " + shlex.quote(words[-1])]]
    if words[0] == "cp":  # copying a file the environment holds (.venv/ is this one)
        return [["-c", "import shutil, sys; shutil.copy(*sys.argv[1:])",
                 *(str(Path(sys.prefix) / w[len(".venv/"):]) if w.startswith(".venv/") else w
                   for w in words[1:])]]
    if words[0] == "torchrun":
        module = words.index("-m")
        return [["-m", "torch.distributed.run", *words[1:module], "-m", "meshtron",
                 *(shortened(words[module + 2 :], cwd, cache) if words[module + 2] == "train"
                   else words[module + 2 :])]]
    assert words[0] == "meshtron", f"a command that is not meshtron: {words}"
    rest = [FEWER.get(before, word) for before, word in zip(["", *words[1:]], words[1:])]
    if rest[0] == "archsearch":  # three proxies of the budget's own sizing, one refined
        rest = [*rest, *ARCHSEARCH_SHORT]
    if rest[0] == "sample-data":
        rest = [*rest, "--max-mb", "1"]
    return [["-m", "meshtron", *(shortened(rest, cwd, cache) if rest[0] == "train" else rest)]]


def run_python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd``, outside any launcher's job environment (forked from the
    tests' fork server: the same interpreter start without re-importing torch each time)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    return forked_python(args, cwd, env, timeout=600)


COMMANDS = readme_commands((ROOT / "README.md").read_text())
DOCS = docs_commands(ROOT / "docs", readme_commands)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> tuple[Path, Path]:
    """The fresh working directory every command runs in, in order, and its data cache."""
    root = tmp_path_factory.mktemp("readme")
    cwd = root / "clone"
    cwd.mkdir()
    shutil.copytree(ROOT / "configs", cwd / "configs")
    shutil.copytree(ROOT / "docs" / "examples", cwd / "docs" / "examples")
    return cwd, root / "cache"


def test_the_readme_has_its_examples():
    assert COMMANDS[:2] == [["make", "train"], ["make", "test"]] and len(COMMANDS) > 20


def test_docs_commands_name_their_run_dir():
    """A docs command that trains names its own run.dir (``runs/default`` is ``make train``'s,
    and another model's run there is refused); a ``train.yaml`` that ``meshtron convert``
    wrote names the imported model's, and ``...`` marks an incomplete example."""
    trains = [words for _, words in DOCS if "train" in words[:6] and "meshtron" in words[:6]]
    assert len(trains) > 10
    for words in trains:
        assert any(w.startswith("--run.dir=") for w in words) or "..." in words or any(
            w.endswith("/train.yaml") for w in words), f"no --run.dir: {' '.join(words)}"


def test_every_docs_command_not_run_is_listed_once():
    """Each entry of DOCS_NOT_RUN names commands the docs still hold (none stale)."""
    for key in DOCS_NOT_RUN:
        assert any(not_run_reason(doc, words) == DOCS_NOT_RUN[key] and doc == key[0]
                   and " ".join(words).startswith(key[1]) for doc, words in DOCS), key
    assert sum(not_run_reason(doc, words) is None for doc, words in DOCS) > 15


@pytest.mark.slow
@pytest.mark.parametrize("words", COMMANDS, ids=[f"{i:02d}-{w[1]}" for i, w in enumerate(COMMANDS)])
def test_readme_command(words, clone):
    """One command (tests run in file order, so each finds what the earlier ones left)."""
    run_in_clone(words, clone)


# the docs commands left out, each with its reason, are checked by the test above
DOCS_RUN = [(i, doc, words) for i, (doc, words) in enumerate(DOCS)
            if not_run_reason(doc, words) is None]


@pytest.mark.slow
@pytest.mark.parametrize("doc, words", [(doc, words) for _, doc, words in DOCS_RUN],
                         ids=[f"{doc[:-3]}-{i:02d}-{w[0]}" for i, doc, w in DOCS_RUN])
def test_docs_command(doc, words, clone):
    """One docs command, after the README's (their runs and files are there)."""
    run_in_clone(words, clone)


def run_in_clone(words: list[str], clone: tuple[Path, Path]) -> None:
    """Run what ``words`` stands for in the clone; it must succeed without a traceback."""
    cwd, cache = clone
    for args in argv(words, cwd, cache) or []:
        started = time.monotonic()
        proc = run_python(args, cwd)
        shown = " ".join(words)
        print(f"{time.monotonic() - started:6.1f} s  {shown}")
        assert proc.returncode == 0, f"`{shown}` failed:\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, f"`{shown}`:\n{proc.stderr[-3000:]}"
        if words[1:2] == ["plot"]:
            assert (cwd / "compare.png").is_file()
