"""Low-precision recipes against bf16 on CPU: the final validation loss of each, side by side.

Trains one small model from the same seed and data with each recipe (bf16, FP8 tensor-wise,
FP8 block-wise, MXFP8, NVFP4; the FP8/FP4 products emulated exactly on CPU), evaluates the
validation loss at intervals and prints a table of final validation losses and their gap to
bf16, and writes the curves (JSON and a PNG) for docs/precision.md.

    .venv/bin/python benchmarks/precision_convergence.py --steps 600 --evals 12 \
        --eval-batches 16 --corpus-mb 3 --out runs/precision

(the figures of docs/precision.md; on the default 0.3 MB a 2,000-step run learns the corpus by
heart and its final gaps measure memorisation). ``--seed N`` repeats it from another seed (one
seed's gap is within the seed-to-seed spread), ``--hidden 256`` on a model whose reduction
dimensions are 8 MX blocks or more rather than 2; one ``--out`` per invocation.

Each run goes through the trainer (``meshtron.training.trainer.Trainer``), as
``meshtron train`` would.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

RECIPES = {
    "bf16": [],
    "fp8 blockwise": ["--precision.fp8=blockwise", "--precision.fp8_block=32"],
    "mxfp8": ["--precision.fp8=mxfp8"],
    "mxfp8 e4m3 grads": ["--precision.fp8=mxfp8", "--precision.fp8_grad=e4m3"],
    "nvfp4": ["--precision.fp4=nvfp4"],
    "fp8 tensorwise": ["--precision.fp8=tensorwise"],
}
"""bf16 first: the baseline of the gaps."""

MODEL = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_heads=4",
         "--model.num_kv_heads=4", "--model.ffn_hidden_size=128", "--model.max_seq_len=64",
         "--data.vocab_size=512", "--data.corpus_max_mb=0.3", "--train.seq_len=32",
         "--train.global_batch=8", "--train.lr=0.003", "--train.min_lr=0.0003",
         "--train.warmup_steps=10", "--train.eval_batches=4", "--train.peak_flops=1e12",
         "--run.progress=false", "--run.plot=false", "--checkpoint.resume=false",
         "--checkpoint.every=0", "--precision.dtype=bf16"]
"""The test suite's 2-layer, 64-wide model (tests/parity.py) in bf16."""


def emulate_per_tensor_products() -> None:
    """Tensor-wise FP8 products through the emulation (dequantised operands multiplied in
    fp32) instead of torch's CPU ``_scaled_mm``: the same numbers up to fp32 accumulation
    order, where that kernel took 374 s for 4 steps and 4 evaluations of this model on a
    shared 2-core CPU (the emulation: 30 s)."""
    import meshtron.precision.fp8 as fp8

    def cuda_only(device, *args) -> bool:
        return device.type != "cpu" and supported(device, *args)

    supported = fp8.scaled_mm_supported
    fp8.scaled_mm_supported = cuda_only


def run(name: str, knobs: list[str], steps: int, root: Path, cache: str, evals: int = 4,
        data: tuple[str, ...] = ()) -> dict:
    """One recipe's training: per-step losses, ``evals`` validation losses and seconds;
    ``data``: overrides of the corpus size and evaluation batches."""
    from meshtron.config import load_config
    from meshtron.training.trainer import Trainer

    every = max(1, steps // evals)
    run_dir = root / name.replace(" ", "-")
    cfg = load_config(overrides=MODEL + list(data) + knobs + [
        f"--train.steps={steps}", f"--train.eval_every={every}", f"--train.log_every={every}",
        f"--data.cache_dir={cache}", f"--run.dir={run_dir}"])
    start = time.perf_counter()
    result = Trainer(cfg, log=lambda message: None).run()
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    return {"recipe": name, "overrides": knobs, "data": list(data), "losses": result.losses,
            "val": val, "final_val_loss": result.val_loss, "seconds": seconds}


def tail_mean(losses: list[float], fraction: float = 0.1) -> float:
    """The mean training loss over the last ``fraction`` of the steps: steadier than one
    evaluation of a few batches."""
    tail = losses[-max(1, int(len(losses) * fraction)):]
    return sum(tail) / len(tail)


def table(results: list[dict]) -> str:
    """Markdown rows: recipe, final validation loss and its gap to bf16, the mean training loss
    of the last 10% of the steps and its gap, seconds."""
    base, base_train = results[0]["final_val_loss"], tail_mean(results[0]["losses"])
    lines = ["| recipe | final val loss | gap vs bf16 | train loss, last 10% of steps | gap vs "
             "bf16 | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        gap = (r["final_val_loss"] - base) / base
        train = tail_mean(r["losses"])
        lines.append(f"| {r['recipe']} | {r['final_val_loss']:.4f} | {gap:+.2%} | {train:.4f} "
                     f"| {(train - base_train) / base_train:+.2%} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def smoothed(losses: list[float], window: int = 50) -> list[float]:
    """Each step's mean over the last ``window`` steps: the curves of several recipes differ
    by less than one step's noise, which would hide them."""
    out, total = [], 0.0
    for i, loss in enumerate(losses):
        total += loss - (losses[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: list[dict], path: Path) -> None:
    """Training and validation loss curves of every recipe side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        train_ax.plot(range(1, len(r["losses"]) + 1), smoothed(r["losses"]), label=r["recipe"],
                      lw=1)
        val_ax.plot(*zip(*r["val"]), marker="o", label=r["recipe"], lw=1)
    train_ax.set(title="training loss (mean of the last 50 steps)", xlabel="step",
                 ylabel="loss")
    val_ax.set(title="validation loss", xlabel="step")
    val_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def model_knobs(args: argparse.Namespace) -> list[str]:
    """The seed and width overrides of the command line (none for the defaults)."""
    knobs = [f"--train.seed={args.seed}"] if args.seed is not None else []
    if args.hidden != 64:
        knobs += [f"--model.hidden_size={args.hidden}",
                  f"--model.ffn_hidden_size={2 * args.hidden}"]
    return knobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--evals", type=int, default=4,
                        help="validation evaluations per run (the curve's points)")
    parser.add_argument("--out", type=Path, default=Path("runs/precision-convergence"))
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help="comma-separated subset of: " + ", ".join(RECIPES))
    parser.add_argument("--scaled-mm", action="store_true",
                        help="tensor-wise FP8 through torch's CPU _scaled_mm (slow), not the "
                        "emulation")
    parser.add_argument("--corpus-mb", type=float, default=0.3,
                        help="MB of the default corpus (0.3: the test model's; a 2,000-step "
                        "run learns that by heart, its validation loss rising after ~1,600)")
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None,
                        help="train.seed (initial weights and data order; the config's 1234 "
                        "by default): the spread of one recipe over seeds is the noise a gap "
                        "must exceed")
    parser.add_argument("--hidden", type=int, default=64,
                        help="model.hidden_size (ffn twice it; 64: the test model, whose "
                        "reduction dims are two MX blocks); 256 or more for block scaling as "
                        "real models see it")
    parser.add_argument("--tabulate", action="store_true",
                        help="train nothing: the table and plot of the recipes' JSON files "
                        "already in --out (from earlier invocations)")
    args = parser.parse_args()
    if args.tabulate:
        found = [args.out / f"{name.replace(' ', '-')}.json" for name in args.recipes.split(",")]
        results = [json.loads(path.read_text()) for path in found if path.exists()]
        plot(results, args.out / "curves.png")
        print(table(results))
        return
    if not args.scaled_mm:
        emulate_per_tensor_products()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="meshtron-precision-")
    names = args.recipes.split(",")
    results = []
    for name in names:
        data = (f"--data.corpus_max_mb={args.corpus_mb}",
                f"--train.eval_batches={args.eval_batches}", *model_knobs(args))
        results.append(run(name, RECIPES[name], args.steps, args.out, cache, args.evals, data))
        slug = name.replace(" ", "-")
        (args.out / f"{slug}.json").write_text(json.dumps(results[-1]))  # kept if a later dies
        print(f"{name}: final validation loss {results[-1]['final_val_loss']:.4f} "
              f"({results[-1]['seconds']:.0f} s)", flush=True)
    (args.out / "curves.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "curves.png")
    print(table(results))


if __name__ == "__main__":
    main()
