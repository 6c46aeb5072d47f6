"""The ``meshtron archsearch`` command line: its flags and help, without importing torch (so
that ``meshtron --help`` stays instant)."""

from __future__ import annotations

import argparse

from meshtron.config.parse import OnceAction

ARCHSEARCH_EPILOG = """\
on this machine (a FLOP budget; proxies are real `meshtron train` runs of a few shapes):
  meshtron archsearch --budget-flops 2e13 --data.vocab_size=2048 --train.seq_len=128 \\
      --json arch.json --output-config arch.yaml --plot arch.png --proxy-dir proxies
on a cluster (time on it; the proxies still train here, so say how long):
  meshtron archsearch --budget-gpu-hours 20000 --cluster.gpu=h100-sxm --cluster.gpus=256 \\
      --model.vocab_size=128256 --law chinchilla --json arch.json
  --layers/--widths/...   the grid (default: centred on the budget); --model.X=V pins X
  --law                   chinchilla, E,A,alpha,B,beta or an earlier --json: no proxy runs
See docs/archsearch.md."""


def cmd_archsearch(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.archsearch.archsearch_command import run_archsearch

    return run_archsearch(args, extra)


def add_archsearch_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "archsearch", help="choose a model shape for a compute budget (scaling law + cost model)",
        description="Fit a scaling law L(N, D) to short proxy runs, price each candidate shape "
        "on the cluster with the cost model, and choose the shape with the lowest predicted "
        "loss for the budget.", epilog=ARCHSEARCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action=OnceAction,
                   help="YAML config (data, batch, precision; model fields pin)")
    p.add_argument("--budget-flops", type=float, help="the training budget in FLOPs (e.g. 1e21)")
    p.add_argument("--budget-gpu-hours", type=float,
                   help="the budget as GPU-hours on the cluster (instead of --budget-flops)")
    p.add_argument("--memory-limit",
                   help="bytes per GPU (or per process without a cluster), e.g. 40GiB or 8e9; "
                   "default: the profile's memory, or this host's memory / --nproc")
    p.add_argument("--json", help="write the chosen shape and the Pareto front to this JSON")
    p.add_argument("--output-config", help="write the chosen model as a config YAML for train")
    p.add_argument("--plot", help="write the front and the fit as a PNG")
    p.add_argument("--top", type=int, default=10,
                   help="rows of the table of best shapes (default 10)")
    grid = p.add_argument_group("the grid (comma-separated lists; a pinned --model.X wins)")
    grid.add_argument("--layers", help="depths (default: centred on the budget)")
    grid.add_argument("--widths", help="hidden sizes (default: centred on the budget)")
    grid.add_argument("--head-dims", help="head widths (default: 16-128, growing with width)")
    grid.add_argument("--kv-groups",
                      help="query heads per kv head (default: the base model's)")
    grid.add_argument("--ffn-ratios", help="FFN size / width (default: the base model's)")
    grid.add_argument("--experts", help="routed experts, 0 for dense (default: the base's)")
    grid.add_argument("--top-k", help="experts per token (default: the base's)")
    proxy = p.add_argument_group("proxy runs (the scaling law's data)")
    proxy.add_argument("--law", help="skip proxies: chinchilla, E,A,alpha,B,beta, or a JSON "
                       "an earlier archsearch wrote")
    proxy.add_argument("--proxies", type=int, default=6,
                       help="proxy shapes to train (default 6, log-spaced in size)")
    proxy.add_argument("--proxy-fraction", type=float, default=0.25,
                       help="FLOPs of each proxy run as a fraction of the budget (default "
                       "0.25; without a cluster)")
    proxy.add_argument("--proxy-steps", type=int,
                       help="steps of every proxy run (instead of --proxy-fraction)")
    proxy.add_argument("--proxy-points", type=int, default=8,
                       help="evaluations per proxy run, each a point of the fit (default 8)")
    proxy.add_argument("--refine", type=int, default=2,
                       help="then train the shapes the first fit ranks best twice as far and "
                       "fit again (default 2; 0: off; not with a cluster)")
    proxy.add_argument("--proxy-layers", help="depths of the proxy shapes (default: --layers)")
    proxy.add_argument("--proxy-widths", help="widths of the proxy shapes (default: --widths)")
    proxy.add_argument("--proxy-dir",
                       help="keep proxy runs here; a rerun reuses the finished ones")
    proxy.add_argument("--proxy-timeout", type=float, default=1800.0,
                       help="seconds before a proxy run is stopped (default 1800)")
    proxy.add_argument("--max-minutes", type=float, metavar="M",
                       help="wall-clock bound: no proxy starts after M minutes (a running one "
                       "is stopped) and the fit uses the proxies that finished")
    proxy.add_argument("--nproc", type=int, default=1,
                       help="local processes of each proxy run and, without a cluster, of the "
                       "chosen model's run (default 1)")
    p.add_argument("--search-top", type=int, default=24,
                   help="on a cluster: shapes whose layouts are searched at least (default 24)")
    p.set_defaults(func=cmd_archsearch)
    return p
