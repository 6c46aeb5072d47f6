"""Fault trials: real processes killed, counted by what survived (issue 17's acceptance).

1. ``--kills N``: N runs of ``meshtron train --nproc 2 --max-restarts 1``, each with rank 1
   SIGKILLed (``MESHTRON_FAULTS``) at a random step; a trial passes when the run exits 0 and
   every step's loss equals an uninterrupted run's bit for bit (the replayed steps included:
   the first attempt's rows are in ``metrics.replaced.jsonl``).
2. ``--save-kills N``: N one-process runs SIGKILLed from outside the moment the temporary
   directory of a save (of a random step from 2 to 6, or the first after it) appears; a trial
   passes when the next run resumes from the newest complete checkpoint, which is older than
   the interrupted save.

From the repository root (about 4 minutes on 2 cores for 10 + 10)::

    .venv/bin/python benchmarks/fault_trials.py [--kills 10] [--save-kills 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.parity import test_overrides  # noqa: E402 - the suite's tiny model and data

STEPS = 8


def _env(faults: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MESHTRON_", "SLURM_")) and k not in ("RANK", "WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", "MESHTRON_FAULTS": faults}


def _train(cache: str, run: Path, *extra: str, faults: str = "",
           nproc: int = 2) -> subprocess.CompletedProcess:
    args = test_overrides(cache, str(run), STEPS) + [
        "--checkpoint.resume=true", "--checkpoint.every=2", "--train.log_every=1"]
    return subprocess.run([sys.executable, "-m", "meshtron", "train", "--nproc", str(nproc),
                           *extra, *args], capture_output=True, text=True, timeout=600,
                          env=_env(faults), cwd=ROOT)


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [row for row in map(json.loads, path.read_text().splitlines()) if "event" not in row]


def kill_trials(cache: str, scratch: Path, trials: int, rng: random.Random) -> int:
    reference = {r["step"]: r["loss"] for r in _rows(
        _check(_train(cache, scratch / "whole"), scratch / "whole") / "metrics.jsonl")}
    passed = 0
    for trial in range(trials):
        step = rng.randint(2, STEPS)
        run = scratch / f"kill-{trial}"
        proc = _train(cache, run, "--max-restarts", "1", faults=f"kill:rank=1:step={step}")
        final = {r["step"]: r["loss"] for r in _rows(run / "metrics.jsonl")}
        replayed = _rows(run / "metrics.replaced.jsonl")
        ok = (proc.returncode == 0 and final == reference
              and all(reference[r["step"]] == r["loss"] for r in replayed)
              and "restarting every rank" in proc.stderr)
        passed += ok
        print(f"kill trial {trial + 1}: rank 1 killed at step {step}; "
              f"{len(replayed)} steps replayed; {'pass' if ok else 'FAIL'}", flush=True)
    return passed


def save_kill_trials(cache: str, scratch: Path, trials: int, rng: random.Random) -> int:
    passed = 0
    for trial in range(trials):
        target = rng.randint(2, 6)  # interrupt the first save of this step or later
        run = scratch / f"save-kill-{trial}"
        root = run / "checkpoints"
        model = test_overrides(cache, str(run), 200) + [
            "--model.hidden_size=128", "--model.ffn_hidden_size=512"]
        args = model + ["--checkpoint.every=1", "--checkpoint.keep_last=2"]
        proc = subprocess.Popen([sys.executable, "-m", "meshtron", "train", *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=_env(), cwd=ROOT)
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            if root.is_dir() and list(root.glob("step_*")):
                in_flight = [int(p.name.split("_")[1].split("-")[0])
                             for p in root.glob(".tmp-step_*")]
                if in_flight and in_flight[0] >= target:
                    proc.send_signal(signal.SIGKILL)
                    killed = in_flight[0]
            time.sleep(0.0005)
        proc.kill()
        proc.wait()
        newest = max(int(p.name.split("_")[1]) for p in root.glob("step_*"))
        resumed = subprocess.run(
            [sys.executable, "-m", "meshtron", "train", *model, "--checkpoint.resume=true",
             f"--train.steps={newest + 1}", "--checkpoint.every=0"],
            capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
        ok = (killed is not None and newest < killed and resumed.returncode == 0
              and f"step_{newest:08d} at step {newest}" in resumed.stdout)
        passed += ok
        print(f"save-kill trial {trial + 1}: killed while saving step {killed}; resumed from "
              f"step {newest}; {'pass' if ok else 'FAIL'}", flush=True)
    return passed


def _check(proc: subprocess.CompletedProcess, run: Path) -> Path:
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{proc.stderr[-2000:]}")
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--save-kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshtron-faults-") as tmp:
        scratch = Path(tmp)
        cache = str(scratch / "cache")
        kills = kill_trials(cache, scratch, args.kills, random.Random(args.seed))
        saves = save_kill_trials(cache, scratch, args.save_kills, random.Random(args.seed + 1))
    print(f"killed rank, restarted, same losses bit for bit: {kills}/{args.kills}")
    print(f"killed during a save, resumed from the previous checkpoint: {saves}/"
          f"{args.save_kills}")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0 if kills == args.kills and saves == args.save_kills else 1


if __name__ == "__main__":
    sys.exit(main())
