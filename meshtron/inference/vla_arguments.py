"""The vision-language-action command line: ``meshtron vla-data`` and ``meshtron evaluate``,
their flags and help, without importing torch (so that ``meshtron --help`` stays instant)."""

from __future__ import annotations

import argparse


def cmd_vla_data(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.inference.evaluate_command import run_vla_data

    return run_vla_data(args, extra)


def cmd_evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.inference.evaluate_command import run_evaluate

    return run_evaluate(args, extra)


def add_vla_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vla-data", help="write scripted-expert demonstrations of the tabletop robot task",
        description="Roll the scripted expert out in the tabletop pick task and write its "
        "successful episodes (images, instruction, actions) as safetensors shards and a JSON "
        "index, for data.path of a vision-language-action model. See docs/vla.md.")
    p.add_argument("--episodes", type=int, required=True, help="demonstrations to write")
    p.add_argument("--output", required=True, help="folder to write (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="seed of the episodes (default 0)")
    p.add_argument("--image-size", type=int, default=32,
                   help="side of the camera images in pixels (default 32)")
    p.set_defaults(func=cmd_vla_data)

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
