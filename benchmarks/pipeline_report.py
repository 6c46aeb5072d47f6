"""How ``benchmarks/pipeline.py`` prints one pipeline size's results (its tables)."""

from __future__ import annotations

import os
from typing import Any

import harness


def print_pp(result: dict[str, Any], args: Any) -> None:
    """The loss check, step times and ratios, best vs best, splits and idle fractions."""
    pp, cores = result["pp"], os.cpu_count() or 1
    first, last = result["first_loss"], result["last_warmup_loss"]
    print(f"\n## pp={pp} ({pp} processes on {cores} cores; load average "
          f"{result['load_average'][0]:.1f} -> {result['load_average'][1]:.1f})")
    if pp > cores:
        print(f"NOTE: {pp} processes on {cores} cores oversubscribe the machine: stages "
              "time-share cores, action durations include waiting for a core, and the idle "
              "fractions below are distorted.")
    print(f"loss check (1e-4 relative, every round): first step "
          f"{min(first.values()):.6f}..{max(first.values()):.6f}, last warm-up step "
          f"{min(last.values()):.6f}..{max(last.values()):.6f} over {len(first)} "
          "configurations: agree")
    for name, error in result["dropped"].items():
        print(f"{name}: does not run on CPU gloo here, left out: {error}")
    print(f"\ns/step: median of {args.rounds} rounds x {args.steps} steps (slowest rank); "
          "ratio = meshtron / torch; pair = median of per-step ratios\n")
    rows = result["configs"]
    paired = {n for p in result["pairs"] for n in (p["meshtron"], p["torch"])}
    print(harness.markdown_table(
        ("schedule", "meshtron s/step", "torch s/step", "ratio", "pair ratio"),
        [*((f"{p['meshtron'].removeprefix('meshtron ')} vs {p['torch']}",
            f"{rows[p['meshtron']]['s_per_step']:.3f}", f"{rows[p['torch']]['s_per_step']:.3f}",
            f"{p['ratio']:.2f}", f"{p['pair_ratio']:.2f}") for p in result["pairs"]),
         *((f"{n} (unpaired)", f"{r['s_per_step']:.3f}", "", "", "")
           for n, r in rows.items() if n not in paired)]))
    best = result["best"]
    if "ratio" in best:
        print(f"\nbest vs best: {best['meshtron']} {rows[best['meshtron']]['s_per_step']:.3f} "
              f"s/step against {best['torch']} {rows[best['torch']]['s_per_step']:.3f}: ratio "
              f"{best['ratio']:.2f}, pair ratio {best['pair_ratio']:.2f}")
    print("layers per virtual stage: " + "; ".join(
        f"{n.removeprefix('meshtron ')} {v}" for n, v in result["partitions"].items()))
    print("\nmeshtron idle fraction (1 - busy / pipeline span; median over timed steps) against "
          "the schedule's closed form and simulation\n")
    print(harness.markdown_table(
        ("schedule", "pipeline span s", "idle per stage", "measured", "theory", "sim. unit",
         "sim. measured costs (per stage)", "replayed", "measured / replayed",
         "measured / theory", "mean F / B / W ms"),
        ((name.removeprefix("meshtron "), f"{b['span_s']:.3f}",
          " / ".join(f"{v:.2f}" for v in b["idle_per_stage"]), f"{b['idle']:.3f}",
          f"{b['theory']:.3f}", f"{b['simulated_unit']:.3f}",
          f"{b['simulated_measured_costs']:.3f} ("
          + " / ".join(f"{v:.2f}" for v in b["simulated_measured_costs_per_stage"]) + ")",
          f"{b['replayed']:.3f}", f"{b['measured_over_replayed']:.2f}",
          f"{b['measured_over_theory']:.2f}",
          " / ".join(f"{1e3 * v:.0f}" for v in b["mean_action_seconds"].values()))
         for name, b in result["bubbles"].items())))
