"""The ``meshtron hpsearch`` command line: its flags and help, without importing Optuna or torch
(so that ``meshtron --help`` stays instant)."""

from __future__ import annotations

import argparse

from meshtron.config.parse import OnceAction

HPSEARCH_EPILOG = """\
the proxy run is the config (--config F and any --section.field=value, as for train); each
trial trains it for train.steps steps and is scored by its final validation loss:
  meshtron hpsearch --model.preset=tiny --train.steps=100 --trials 12 \\
      --space train.lr=1e-4:3e-2:log --space train.global_batch=8,16 \\
      --json hp.json --output-config best.yaml --plot hp.png --study hp.journal
muP transfer, the same learning-rate grid at two widths:
  meshtron hpsearch --model.preset=tiny --model.mup=true --widths 64,256 --sampler grid \\
      --space train.lr=1e-3,2e-3,4e-3,8e-3,1.6e-2 --pruner none --plot lr.png
--space FIELD=LOW:HIGH[:log] (ints for int fields) or FIELD=A,B,C; without --space:
train.lr, train.warmup_steps, train.global_batch and train.weight_decay around the config's.
See docs/hpsearch.md."""


def cmd_hpsearch(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.hpsearch.hpsearch_command import run_hpsearch

    return run_hpsearch(args, extra)


def add_hpsearch_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "hpsearch", help="search learning rate, warm-up, batch and weight decay on proxy runs",
        description="Train short proxy runs as separate processes (successive halving prunes "
        "the poor ones) and keep the best hyper-parameters; with model.mup=true they transfer "
        "to a wider model.", epilog=HPSEARCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action=OnceAction,
                   help="YAML config of the proxy run (the fields as for train)")
    p.add_argument("--trials", type=int, default=None,
                   help="parameter sets to try (default 16; with --sampler grid: the grid)")
    p.add_argument("--json", help="write the best settings and every trial to this JSON file")
    p.add_argument("--output-config", help="write the config with the best settings as YAML")
    p.add_argument("--space", action="append", metavar="FIELD=SPEC",
                   help="a searched field: FIELD=LOW:HIGH[:log] or FIELD=A,B,C (repeatable)")
    p.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe",
                   help="Optuna sampler (default tpe; grid: every combination)")
    p.add_argument("--grid-points", type=int, default=5,
                   help="--sampler grid: points of each range (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    p.add_argument("--pruner", choices=("sha", "hyperband", "none"), default="sha",
                   help="stop poor trials early: successive halving (default), hyperband, none")
    p.add_argument("--reduction-factor", type=int, default=3,
                   help="the pruner's reduction factor: rungs every factor x (default 3)")
    p.add_argument("--min-steps", type=int, default=None,
                   help="the first rung, in steps of the config's batch (default: train.steps"
                   " / factor^2, after the warm-up)")
    p.add_argument("--widths", help="proxy widths, e.g. 64,256: every trial runs at each "
                   "(model.hidden_size and the FFN set, heads kept)")
    p.add_argument("--nproc", type=int, default=1, help="processes per trial (default 1)")
    p.add_argument("--study", help="Optuna journal file: kept, and resumed when it exists")
    p.add_argument("--trial-dir", help="where trial runs go (default: next to --study as "
                   "F.runs, else a temporary folder)")
    p.add_argument("--trial-timeout", type=float, default=3600.0,
                   help="seconds before a trial is stopped as failed (default 3600)")
    p.add_argument("--max-minutes", type=float, metavar="M",
                   help="wall-clock bound: no trial starts after M minutes (a running one is "
                   "stopped) and the table holds the trials that finished")
    p.add_argument("--plot", help="write loss against the learning rate, per width, to a PNG")
    p.set_defaults(func=cmd_hpsearch)
    return p
