"""μP transfer, measured: the best learning rate across widths with and without model.mup.

Runs ``meshtron hpsearch`` twice over the same learning-rate grid (factor ``--factor`` steps)
at each of ``--widths``, once with ``model.mup=true`` (``model.mup_base_width`` = the first,
narrowest width, so that proxy trains exactly as without μP) and once without. Every trial is
a real ``meshtron train`` process of the same budget, scored by its final validation loss
(no pruning: every grid point runs to the end). It prints the loss of every (μP, width, lr),
the best learning rate per width, and whether the optimum stays within one grid step
(transfers) or moves (drifts); it writes one plot of
the curves (at the base width μP and the standard parameterisation are the same model).

From the repository root (about 12 minutes on 2 busy cores with the defaults: 28 trials)::

    .venv/bin/python benchmarks/mup_transfer.py [--widths 64,256] [--steps 200] \\
        [--batch 16] [--lr-min 6.25e-4] [--out mup-transfer] [--json mup.json]

A shorter budget (100 steps of 8 sequences) was tried first and is too noisy to rank
neighbouring grid points: its curves are not monotone on either side of the optimum.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import cli

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def lr_grid(low: float, factor: float, points: int) -> list[float]:
    return [float(f"{low * factor ** i:.4g}") for i in range(points)]


def model_args(args: Any) -> list[str]:
    return [f"--model.preset={args.preset}", f"--model.num_layers={args.layers}",
            f"--model.num_heads={args.heads}", f"--model.num_kv_heads={args.heads}",
            f"--model.hidden_size={args.widths[0]}",
            f"--model.ffn_hidden_size={3 * args.widths[0]}", "--data.vocab_size=512",
            f"--data.corpus_max_mb={args.corpus_mb}", f"--train.seq_len={args.seq_len}",
            f"--train.global_batch={args.batch}", f"--train.steps={args.steps}",
            f"--train.warmup_steps={max(1, args.steps // 10)}", "--train.eval_batches=8",
            f"--train.seed={args.seed}"]


def search(args: Any, mup: bool, lrs: list[float], out: Path) -> dict[str, Any]:
    """One ``meshtron hpsearch`` over the grid at every width; its JSON."""
    name = "mup" if mup else "standard"
    command = [sys.executable, "-m", "meshtron", "hpsearch", *model_args(args),
               f"--model.mup={'true' if mup else 'false'}",
               f"--model.mup_base_width={args.widths[0]}",
               "--widths", ",".join(map(str, args.widths)), "--sampler", "grid",
               "--pruner", "none", "--space", "train.lr=" + ",".join(map(str, lrs)),
               "--json", str(out / f"{name}.json"), "--plot", str(out / f"{name}.png"),
               "--trial-dir", str(out / f"{name}-runs")]
    print("$ " + " ".join(command[1:]), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"hpsearch ({name}) failed:\n{proc.stderr[-3000:]}")
    print(f"  {name}: {time.monotonic() - started:.0f} s", flush=True)
    return json.loads((out / f"{name}.json").read_text())


def losses(data: dict[str, Any]) -> dict[tuple[int, float], float | None]:
    return {(t["width"], t["params"]["train.lr"]): t["loss"] for t in data["trials"]}


def best_lr(table: dict[tuple[int, float], float | None], width: int) -> float | None:
    points = [(loss, lr) for (w, lr), loss in table.items()
              if w == width and loss is not None and math.isfinite(loss)]
    return min(points)[1] if points else None


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")],
                        default=[64, 256], help="widths, narrowest first (default 64,256)")
    parser.add_argument("--lr-min", type=float, default=6.25e-4, help="lowest learning rate")
    parser.add_argument("--factor", type=float, default=2.0, help="grid step (default 2)")
    parser.add_argument("--points", type=int, default=7, help="grid points (default 7)")
    parser.add_argument("--steps", type=int, default=200, help="steps of every trial")
    parser.add_argument("--batch", type=int, default=16, help="train.global_batch")
    parser.add_argument("--seq-len", type=int, default=32, help="train.seq_len")
    parser.add_argument("--layers", type=int, default=2, help="model.num_layers")
    parser.add_argument("--heads", type=int, default=4, help="model.num_heads (kept)")
    parser.add_argument("--preset", default="tiny", help="model.preset the shape starts from")
    parser.add_argument("--corpus-mb", type=float, default=0.5, help="data.corpus_max_mb")
    parser.add_argument("--seed", type=int, default=1234, help="train.seed")
    parser.add_argument("--out", type=Path, default=Path("mup-transfer"),
                        help="folder for the searches' JSON, plots and runs")
    args = parser.parse_args()
    args.out = args.out.absolute()
    args.out.mkdir(parents=True, exist_ok=True)
    info = harness.host_info()
    lrs = lr_grid(args.lr_min, args.factor, args.points)
    print(harness.host_line(info, f"widths {args.widths}, {args.steps} steps of "
                            f"{args.batch}x{args.seq_len} tokens, lr grid {lrs}"), flush=True)
    results = {name: losses(search(args, name == "mup", lrs, args.out))
               for name in ("mup", "standard")}
    header = ["lr"] + [f"{name} w{w}" for name in results for w in args.widths]
    rows = [[f"{lr:.4g}"] + [f"{results[n][(w, lr)]:.4f}" if results[n].get((w, lr)) is not None
                             else "failed" for n in results for w in args.widths]
            for lr in lrs]
    print(harness.markdown_table(header, rows))
    verdict = {}
    for name, table in results.items():
        best = {w: best_lr(table, w) for w in args.widths}
        steps = {w: lrs.index(b) for w, b in best.items() if b is not None}
        spread = max(steps.values()) - min(steps.values()) if len(steps) == len(best) else None
        edge = [w for w, i in steps.items() if i in (0, len(lrs) - 1)]
        verdict[name] = {"best_lr": best, "grid_steps_apart": spread, "at_grid_edge": edge}
        print(f"{name}: best lr per width " + ", ".join(
            f"{w}: {b:.4g}" for w, b in best.items() if b is not None)
            + f" ({spread} grid step{'s' if spread != 1 else ''} apart"
            + (f"; at the grid's edge for width {', '.join(map(str, edge))}" if edge else "")
            + ")")
    mup, standard = (verdict[n]["grid_steps_apart"] for n in ("mup", "standard"))
    transfers = mup is not None and mup <= 1
    drifts = standard is not None and standard >= 1
    print(f"with model.mup the optimum {'transfers' if transfers else 'does NOT transfer'} "
          f"(best lrs {mup} grid steps apart, one allowed); without it the optimum "
          f"{'drifts' if drifts else 'does NOT drift'} ({standard} grid steps apart)")
    verdict["transfers"], verdict["drifts"] = transfers, drifts
    from meshtron.hpsearch.ranking import plot_series

    series = {}
    for name, table in results.items():
        for w in args.widths:
            if w == args.widths[0] and name == "standard":
                continue  # at the base width μP is the standard parameterisation
            label = (f"width {w} (the base width: μP = standard)" if w == args.widths[0]
                     else f"{name} width {w}")
            series[label] = [(lr, loss) for (ww, lr), loss in table.items()
                             if ww == w and loss is not None and math.isfinite(loss)]
    plot_series(series, args.out / "mup_transfer.png", "train.lr",
                f"final validation loss after {args.steps} steps", log_x=True)
    print(f"plot: {args.out / 'mup_transfer.png'}")
    harness.write_json(args.json, harness.record(
        info, args=harness.plain_args(args), lrs=lrs,
        losses={n: {f"{w}@{lr}": v for (w, lr), v in t.items()} for n, t in results.items()},
        verdict=verdict))


if __name__ == "__main__":
    main()
