"""A standing mutation pass: plausible bugs planted one at a time, and the tests that must see them.

Each mutant is an exact replacement (file, old text, new text) applied to a copy of the
committed tree (``git archive HEAD``, never the working tree), followed by the tests aimed at
that code, one pytest process per mutant with a time limit (a mutant that hangs its tests is
counted as caught: something noticed). A mutant is *caught* when its tests fail, *survived*
when they pass; a survivor is either a gap to close with a new test, or listed in
:data:`EQUIVALENT` with the reason no test can tell it apart (a change of behaviour nothing can
observe). Before any mutant, every targeted test runs once on the unmutated copy and must pass:
a red baseline would make every mutant look caught.

    .venv/bin/python benchmarks/mutation.py [--only REGEX] [--timeout S] [--docs]

``--docs`` rewrites the table in docs/reliability.md (between its mutation markers). One mutant
at a time (the suite's own tests spawn processes; the machine has 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from mutants import EQUIVALENT, MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- mutation-pass:begin -->", "<!-- mutation-pass:end -->"


@dataclass
class Outcome:
    mutant: Mutant
    result: str
    """``caught``, ``timeout`` (caught by hanging), ``survived``, ``equivalent`` (survived,
    explained) or ``stale`` (its old text is not in the file any more)."""
    seconds: float
    detail: str = ""


def copy_tree(into: Path) -> str:
    """The committed tree at HEAD, unpacked into ``into``; returns the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.Popen(["git", "archive", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit("git archive failed")
    return commit


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """pytest on ``tests`` inside ``tree`` (its own package first on the path, for the
    processes the tests start too); (exit code or None on timeout, the last output line)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [str(PYTHON), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"no result in {timeout:.0f} s"
    lines = [line for line in out.splitlines() if line.strip()]
    return proc.returncode, lines[-1] if lines else ""


def try_mutant(tree: Path, mutant: Mutant, timeout: float) -> Outcome:
    """Plant ``mutant`` in ``tree``, run its tests, put the file back."""
    path = tree / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        return Outcome(mutant, "stale", 0.0, f"old text found {original.count(mutant.old)} times")
    path.write_text(original.replace(mutant.old, mutant.new))
    started = time.monotonic()
    try:
        code, last = run_tests(tree, mutant.tests, timeout)
    finally:
        path.write_text(original)
    seconds = time.monotonic() - started
    if code is None:
        return Outcome(mutant, "timeout", seconds, last)
    if code != 0:
        return Outcome(mutant, "caught", seconds, last)
    return Outcome(mutant, "equivalent" if mutant.name in EQUIVALENT else "survived", seconds,
                   last)


def baseline(tree: Path, mutants: list[Mutant], timeout: float) -> None:
    """Every targeted test, unmutated, in one pytest run: it must pass."""
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests if not t.startswith("-")))
    code, last = run_tests(tree, tests, timeout * 4)
    if code != 0:
        raise SystemExit(f"the unmutated tree fails its targeted tests ({last}); fix that first")
    print(f"baseline: {len(tests)} test selections pass ({last})", flush=True)


def table(outcomes: list[Outcome]) -> str:
    rows = ["| mutant | area | file | tests | result | s |",
            "| --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        m = o.mutant
        tests = ", ".join(f"`{t}`" for t in m.tests)
        rows.append(f"| {m.name}: {m.what} | {m.area} | `{m.path}` | {tests} | {o.result} | "
                    f"{o.seconds:.0f} |")
    return "\n".join(rows)


def summary(outcomes: list[Outcome]) -> str:
    counts = {r: sum(o.result == r for o in outcomes)
              for r in ("caught", "timeout", "survived", "equivalent", "stale")}
    real = len(outcomes) - counts["equivalent"] - counts["stale"]
    caught = counts["caught"] + counts["timeout"]
    return (f"**{len(outcomes)} mutants: {caught} caught ({counts['timeout']} of them by a "
            f"time-out), {counts['survived']} survived, {counts['equivalent']} equivalent, "
            f"{counts['stale']} stale; score {caught}/{real}**")


def write_docs(outcomes: list[Outcome], commit: str, seconds: float, command: str) -> None:
    """The table and the equivalent mutants' reasons, between the markers of the doc."""
    today = datetime.date.today().isoformat()
    reasons = "\n".join(f"- **{o.mutant.name}** ({o.mutant.what}): {EQUIVALENT[o.mutant.name]}"
                        for o in outcomes if o.result == "equivalent")
    block = (f"{BEGIN}\nMeasured {today} at {commit} on this 2-core machine, `{command}`, "
             f"{seconds / 60:.0f} min: {summary(outcomes)}.\n\n{table(outcomes)}\n\n"
             + (f"Equivalent mutants (no test can tell them apart):\n\n{reasons}\n" if reasons
                else "") + END)
    text = DOC.read_text()
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text,
                      flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run the mutants whose name matches this regex")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    p.add_argument("--docs", action="store_true", help="write the table to docs/reliability.md")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or re.search(args.only, m.name)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshtron-mutants-") as tmp:
        tree = Path(tmp)
        commit = copy_tree(tree)
        if not args.no_baseline:
            baseline(tree, mutants, args.timeout)
        outcomes = []
        for mutant in mutants:
            outcome = try_mutant(tree, mutant, args.timeout)
            outcomes.append(outcome)
            print(f"{mutant.name:28} {outcome.result:10} {outcome.seconds:6.0f} s  "
                  f"{outcome.detail}", flush=True)
    print(summary(outcomes))
    if args.docs:
        command = (f".venv/bin/python benchmarks/mutation.py --timeout {args.timeout:.0f} --docs"
                   + (f" --only '{args.only}'" if args.only else ""))
        write_docs(outcomes, commit, time.monotonic() - started, command)
    return 1 if any(o.result in ("survived", "stale") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
