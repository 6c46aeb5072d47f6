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
        description="Run a trained policy in its environment (the tabletop task, Meta-World's "
        "MT10 or one of its tasks) on held-out seeds: success rate (mean over tasks) and per "
        "task, episode length, how failed episodes ended, mean return, action-token accuracy on "
        "held-out demonstrations and the control latency. See docs/vla.md.")
    p.add_argument("--checkpoint", required=True, help="a run directory or checkpoint")
    p.add_argument("--env", help="environment to roll out in (default: the one the policy "
                   "was trained for, model.vision.env): tabletop, metaworld-mt10 or "
                   "metaworld:<task>")
    p.add_argument("--episodes", type=int, default=None, help="episodes to roll out per task "
                   "(default 100 for one task, 10 per task for several)")
    p.add_argument("--episodes-per-task", type=int, default=None,
                   help="the same as --episodes (Meta-World's usual name)")
    p.add_argument("--instructions", choices=("held-out", "train"), default="held-out",
                   help="Meta-World: ask with the phrasings held out of the demonstrations "
                   "(default) or with the training ones")
    p.add_argument("--max-steps", type=int, default=None, help="steps before an episode is "
                   "cut off (default: the environment's: tabletop 25, Meta-World 200)")
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--video", metavar="DIR", help="write the first rollouts as GIFs here")
    p.add_argument("--videos", type=int, default=8, help="how many rollouts per task --video "
                   "writes (default 8)")
    p.set_defaults(func=cmd_evaluate)
    return p
