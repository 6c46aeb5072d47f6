"""The README's commands, run as a newcomer would: in order, in one fresh working directory.

Each command runs as written, but shorter: step counts (``--train.steps``,
``checkpoint.every``, ``checkpoint.resume_from`` and those in ``--config`` files) are divided
by 100 (at most 3), a command that names no step count trains one step, an evaluation takes
one batch, sequences are at most 4096 tokens long, and every run reads a 1 MB slice of the
built-in corpus from a private cache. The user's own files the examples name (``corpus.txt``,
``books/``, ``code.jsonl``, ``corpus/``) are made from this Python's sources.
``cp`` copies from this environment (``.venv/`` is ``sys.prefix``).
``meshtron archsearch`` trains 4 proxies of 80 steps and refines one, ``hpsearch`` runs 3
trials and ``evaluate`` 4 episodes.
``make test`` is not run (it is this suite), and ``make train`` runs what the Makefile runs.
"""

from __future__ import annotations

import json
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

from tests.test_cli import _JOB_VARIABLES

ROOT = Path(__file__).resolve().parent.parent
SCALED = ("--train.steps", "--checkpoint.every", "--checkpoint.resume_from",
          "--train.eval_every", "--train.log_every")
MAX_SEQ_LEN = 4096
ARCHSEARCH_SHORT = ("--proxies", "4", "--proxy-steps", "80", "--refine", "1")
FEWER = {"--trials": "3", "--episodes": "4"}
"""Counts of other commands' units of work (hpsearch trials, evaluate's episodes), set small."""
YAML_SCALED = {("train", "steps"), ("checkpoint", "every"), ("train", "eval_every"),
               ("train", "log_every")}


def readme_commands(text: str) -> list[list[str]]:
    """Every command of the README's ``bash`` blocks, as argument lists (comments dropped,
    continued lines joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
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
    return out[: train + 1] + inserted + out[train + 1 :]


def user_files(cwd: Path) -> None:
    """Small stand-ins for the files the examples name."""
    sources = sorted(Path(json.__file__).parent.parent.glob("*.py"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sources[:80]]
    (cwd / "corpus.txt").write_text("\n".join(texts[:20]))
    for folder, chunk in (("books", texts[20:40]), ("corpus", texts[40:60])):
        (cwd / folder).mkdir()
        for i in range(2):
            (cwd / folder / f"part{i}.txt").write_text("\n".join(chunk[i::2]))
    (cwd / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[60:]))


def argv(words: list[str], cwd: Path, cache: Path) -> list[list[str]] | None:
    """The meshtron argument lists a README command stands for (None: not run here)."""
    if words == ["make", "test"]:
        return None
    if words == ["make", "train"]:  # what the Makefile's train target runs
        return [["-m", "meshtron", *shortened(["train", "--config", "configs/default.yaml"],
                                               cwd, cache)],
                ["-m", "meshtron", "generate", "--checkpoint", "runs/default", "--prompt", "def ",
                 "--max-new-tokens", "20"]]
    if words[0] == "cp":  # copying a file the environment holds (.venv/ is this one)
        return [["-c", "import shutil, sys; shutil.copy(*sys.argv[1:])",
                 *(str(Path(sys.prefix) / w[len(".venv/"):]) if w.startswith(".venv/") else w
                   for w in words[1:])]]
    if words[0] == "torchrun":
        module = words.index("-m")
        return [["-m", "torch.distributed.run", *words[1:module], "-m", "meshtron",
                 *shortened(words[module + 2 :], cwd, cache)]]
    assert words[0] == ".venv/bin/meshtron", f"a README command that is not meshtron: {words}"
    rest = [FEWER.get(before, word) for before, word in zip(["", *words[1:]], words[1:])]
    if rest[0] == "archsearch":  # four proxies of the fewest steps the fit allows, one refined
        rest = [*rest, *ARCHSEARCH_SHORT]
    return [["-m", "meshtron", *(shortened(rest, cwd, cache) if rest[0] == "train" else rest)]]


def run_python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd``, outside any launcher's job environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


COMMANDS = readme_commands((ROOT / "README.md").read_text())


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> tuple[Path, Path]:
    """The fresh working directory every command runs in, in order, and its data cache."""
    root = tmp_path_factory.mktemp("readme")
    cwd = root / "clone"
    cwd.mkdir()
    shutil.copytree(ROOT / "configs", cwd / "configs")
    user_files(cwd)
    return cwd, root / "cache"


def test_the_readme_has_its_examples():
    assert COMMANDS[:2] == [["make", "train"], ["make", "test"]] and len(COMMANDS) > 20


@pytest.mark.slow
@pytest.mark.parametrize("words", COMMANDS, ids=[f"{i:02d}-{w[1]}" for i, w in enumerate(COMMANDS)])
def test_readme_command(words, clone):
    """One command (tests run in file order, so each finds what the earlier ones left)."""
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
