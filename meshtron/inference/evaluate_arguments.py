"""The ``meshtron evaluate`` command line: its flags and help, without importing torch (so that
``meshtron --help`` stays instant); :mod:`.evaluate_command` runs it."""

from __future__ import annotations

import argparse


def cmd_evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.inference.evaluate_command import run_evaluate

    return run_evaluate(args, extra)


def add_evaluate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "evaluate", help="roll a vision-language-action policy out in closed loop",
        description="Run a trained policy in the tabletop task on held-out seeds: success "
        "rate, mean return, action-token accuracy on held-out demonstrations and the control "
        "latency. See docs/vla.md.")
    p.add_argument("--checkpoint", required=True, help="a run directory or checkpoint")
    p.add_argument("--episodes", type=int, default=100, help="episodes to roll out "
                   "(default 100)")
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--video", metavar="DIR", help="write the first rollouts as GIFs here")
    p.add_argument("--videos", type=int, default=8, help="how many rollouts --video writes "
                   "(default 8)")
    p.set_defaults(func=cmd_evaluate)
    return p
