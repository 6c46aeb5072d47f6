"""The cost model against published runs: each prediction beside what was measured, the
errors, and the band they give every other prediction.

A run's layout and recipe are pinned as published (:mod:`meshtron.costmodel.published`) and
the cost model prices that one candidate; the comparison is in tokens per second per GPU, the
one figure free of FLOP conventions. The residuals (measured over predicted) are the model's
known error on real clusters: their spread is the band printed beside every plan
(:func:`band`), and the best measured MFU of a GPU generation and model kind (dense or MoE)
is the line a plan's predicted MFU is held against (:func:`best_published_mfu`).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.costmodel.estimate import Estimator
from meshtron.costmodel.published import PublishedRun, generation_of, load_published_runs

BAND_QUANTILES = (0.1, 0.9)
"""The band spans these quantiles of measured / predicted over the published runs."""


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    predicted_tokens_per_s_per_gpu: float
    measured_tokens_per_s_per_gpu: float
    predicted_mfu: float
    breakdown: dict[str, float]
    """Shares of the predicted step by cause (compute, bubble, communication, ...)."""

    @property
    def error(self) -> float:
        """Predicted over measured, less one: positive when the model is optimistic."""
        return self.predicted_tokens_per_s_per_gpu / self.measured_tokens_per_s_per_gpu - 1

    @property
    def ratio(self) -> float:
        """Measured over predicted: what a prediction is multiplied by to meet the cluster."""
        return self.measured_tokens_per_s_per_gpu / self.predicted_tokens_per_s_per_gpu


def compare(run: PublishedRun) -> Comparison:
    """Price the run's published layout and recipe and set it beside the measurement."""
    e = Estimator(run.problem, run.software, run.pp_layers).estimate(run.candidate)
    return Comparison(run, e.tokens_per_s / run.gpus, run.measured_tokens_per_s_per_gpu(),
                      e.mfu, {k: v / e.step_time_s for k, v in e.breakdown.items()})


def published_comparisons() -> tuple[Comparison, ...]:
    """Every published run of the built-in file, compared (about 10 s: planning reads the
    stored figures below instead)."""
    return tuple(compare(run) for run in load_published_runs())


def summary(comparisons: tuple[Comparison, ...]) -> tuple[float, float]:
    """(mean absolute error, worst absolute error) of the predictions."""
    errors = [abs(c.error) for c in comparisons]
    return sum(errors) / len(errors), max(errors)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    position = q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (position - low) * (values[high] - values[low])


def band(comparisons: tuple[Comparison, ...] | None = None) -> tuple[float, float]:
    """(low, high) factors on a predicted throughput: the 10th and 90th percentiles of
    measured / predicted over the published runs."""
    ratios = [c.ratio for c in (comparisons or published_comparisons())]
    return _quantile(ratios, BAND_QUANTILES[0]), _quantile(ratios, BAND_QUANTILES[1])


def best_published_mfu(profile_name: str, moe: bool,
                       comparisons: tuple[Comparison, ...] | None = None
                       ) -> tuple[float, str] | None:
    """The highest measured MFU among published runs of this GPU generation and model kind,
    with the run's name; None when none was published (no claim is then made). FP8 runs are
    left out: their MFU is over the bf16 peak."""
    generation = generation_of(profile_name)
    same = [c.run for c in (comparisons or published_comparisons())
            if c.run.generation == generation and c.run.moe == moe
            and not c.run.problem.fp8]
    if not same:
        return None
    best = max(same, key=lambda r: r.measured_mfu())
    return best.measured_mfu(), best.name


def table_lines(comparisons: tuple[Comparison, ...]) -> list[str]:
    """The comparison as a Markdown table (docs/tuning.md's)."""
    lines = ["| run | GPUs | hardware | layout | measured tok/s/GPU | predicted | error | "
             "measured MFU |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for c in comparisons:
        r = c.run
        fp8 = " fp8" if r.problem.fp8 else ""
        lines.append(f"| {r.name} | {r.gpus:,} | {r.hardware}{fp8} | "
                     f"{r.candidate.describe()} | {c.measured_tokens_per_s_per_gpu:,.1f} | "
                     f"{c.predicted_tokens_per_s_per_gpu:,.1f} | {c.error:+.1%} | "
                     f"{r.measured_mfu():.1%} |")
    mae, worst = summary(comparisons)
    lines.append(f"\nMean absolute error {mae:.1%}, worst {worst:.1%} over "
                 f"{len(comparisons)} runs.")
    sheet = tuple(c for c in comparisons if c.run.data_sheet)
    if sheet and len(sheet) < len(comparisons):
        mae, worst = summary(sheet)
        lines.append(f"On the {len(sheet)} runs on data-sheet GPUs (a built-in profile whose "
                     f"peak is published, unchanged): mean absolute error {mae:.1%}, worst "
                     f"{worst:.1%}.")
    return lines


STORED_BAND = (0.768, 1.115)
""":func:`band` over the built-in runs, stored so that planning does not price 29 published
runs each time (tests/test_published_runs.py recomputes it and fails when it is stale)."""
STORED_BEST_MFU = {("a100", False): (0.392, "narayanan2021-1t-3072gpu"),
                   ("h100", False): (0.495, "megatron-h100-16b-192gpu"),
                   ("h100", True): (0.473, "mcore-mixtral-8x7b-64gpu")}
""":func:`best_published_mfu` by (generation, MoE) over the built-in runs, stored likewise."""
STORED_RUNS = 29


def plan_confidence(tflops_per_gpu: float, mfu: float, profile_name: str, moe: bool,
                    gpu: bool, fp8: bool = False) -> tuple[list[str], dict]:
    """What a plan's figures are worth: the band from the published residuals (GPU profiles
    only: the runs were measured on GPUs) and, where its predicted MFU is above every
    published run of its GPU generation and kind, a line saying so (not for FP8 plans: their
    MFU is over the bf16 peak). Returns the printed lines and the JSON entry."""
    if not gpu:
        return [], {}
    low, high = STORED_BAND
    lines = [f"confidence: {STORED_RUNS} published runs measured {low:.2f}-{high:.2f}x what "
             f"the cost model predicts for them (10th-90th percentile): the first plan's "
             f"{tflops_per_gpu:.1f} TFLOP/s per GPU is likely {tflops_per_gpu * low:.1f}-"
             f"{tflops_per_gpu * high:.1f} (docs/tuning.md)"]
    entry: dict = {"band": [low, high], "band_quantiles": list(BAND_QUANTILES),
                   "tflops_per_gpu_band": [tflops_per_gpu * low, tflops_per_gpu * high],
                   "published_runs": STORED_RUNS}
    best = None if fp8 else STORED_BEST_MFU.get((generation_of(profile_name), moe))
    if best is not None:
        entry["best_published_mfu"], entry["best_published_run"] = best
        entry["above_published"] = mfu > best[0]
        if mfu > best[0]:
            kind = "MoE" if moe else "dense"
            lines.append(f"note: the predicted MFU {mfu:.1%} is above every published "
                         f"{generation_of(profile_name)} {kind} run (best {best[0]:.1%}, "
                         f"{best[1]}): treat it as optimistic")
    return lines, entry
