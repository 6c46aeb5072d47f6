"""``meshtron vla-data``: the scripted expert's demonstrations of the tabletop pick task,
written as training data for a vision-language-action model (safetensors shards and a JSON
index, :mod:`.episodes`), for its ``data.path``. See docs/vla.md.

The environment and the expert (:mod:`.demonstrations`) are imported only once the command
runs (``meshtron --help`` builds this parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtron.errors import MeshtronError


def add_vla_data_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    p.set_defaults(func=run_vla_data)
    return p


def run_vla_data(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"vla-data takes no config overrides, got {' '.join(extra)}")
    if args.episodes < 1:
        raise MeshtronError(f"--episodes must be at least 1, got {args.episodes}")
    output = Path(args.output)
    if output.exists():
        raise MeshtronError(f"--output {output} already exists; name a new folder")
    from meshtron.data.demonstrations import generate_demonstrations

    generate_demonstrations(args.episodes, args.seed, args.image_size, output)
    return 0
