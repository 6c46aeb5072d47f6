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
        "vla-data", help="write scripted-expert demonstrations of a robot task",
        description="Roll the scripted expert out in an environment (the tabletop pick task, "
        "Meta-World's MT10 or one of its tasks) and write its successful episodes (images, "
        "instruction, actions) as safetensors shards and a JSON index, for data.path of a "
        "vision-language-action model. See docs/vla.md.")
    p.add_argument("--env", default="tabletop", help="tabletop (default), metaworld-mt10 or "
                   "metaworld:<task>")
    p.add_argument("--episodes", type=int, required=True, help="demonstrations to write "
                   "(over MT10: split evenly over its ten tasks)")
    p.add_argument("--output", help="folder to write (must not exist); default: the cache "
                   "(data.cache_dir's demonstrations/, reused when already there)")
    p.add_argument("--seed", type=int, default=0, help="seed of the episodes (default 0)")
    p.add_argument("--image-size", type=int, default=None,
                   help="side of the camera images in pixels (default 32; Meta-World 64)")
    p.add_argument("--workers", type=int, default=None, help="processes rolling Meta-World's "
                   "experts out (default: the CPUs this process may use, at most 8)")
    p.add_argument("--cache-dir", default="~/.cache/meshtron", help="the cache without "
                   "--output (default ~/.cache/meshtron)")
    p.set_defaults(func=run_vla_data)
    return p


def run_vla_data(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"vla-data takes no config overrides, got {' '.join(extra)}")
    if args.episodes < 1:
        raise MeshtronError(f"--episodes must be at least 1, got {args.episodes}")
    if args.workers is not None and args.workers < 1:
        raise MeshtronError(f"--workers must be at least 1, got {args.workers}")
    from meshtron.data.demonstrations import default_demonstrations, generate_demonstrations
    from meshtron.envs import DEFAULT_ENV, check_env_name

    check_env_name(args.env)
    size = args.image_size or (32 if args.env == DEFAULT_ENV else 64)
    if args.output is None:
        default_demonstrations(Path(args.cache_dir).expanduser(), args.episodes, args.seed,
                               size, env=args.env)
        return 0
    output = Path(args.output)
    if output.exists():
        raise MeshtronError(f"--output {output} already exists; name a new folder")
    generate_demonstrations(args.episodes, args.seed, size, output, env=args.env,
                            workers=args.workers)
    return 0
