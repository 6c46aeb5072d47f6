"""The ``meshtron train`` command line: its flags and help (every config field, from the
schema's docstrings), and what can be refused before torch is imported: the flags themselves
and the config (an unknown key or a bad value is said at once); :mod:`.train_command` runs it."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from meshtron.config import load_config, split_overrides
from meshtron.config.checks import inert_settings
from meshtron.config.docs import config_reference, help_width
from meshtron.config.parse import OnceAction
from meshtron.errors import MeshtronError


def add_train_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="train a model (resumes from the newest checkpoint)",
        description=textwrap.fill("Train a model. Settings come from the defaults, then "
                                  "--config, then --section.field=value overrides.",
                                  help_width()),
        epilog=config_reference(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", action=OnceAction,
                   help="YAML file with config sections (once; change its values with "
                   "--section.field=value)")
    p.add_argument("--nproc", type=int, default=1, help="number of local processes (default 1)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="when a rank fails, restart every rank from the newest checkpoint, up "
                   "to R times (default 0)")
    p.add_argument("--min-nproc", type=int, default=None, metavar="M",
                   help="with --max-restarts: continue each restart on fewer ranks (the "
                   "largest count the layout accepts, down to M), resharding the checkpoint")
    p.set_defaults(func=cmd_train)
    return p


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    if args.nproc < 1:
        raise MeshtronError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise MeshtronError(f"--max-restarts must not be negative, got {args.max_restarts}")
    if args.min_nproc is not None and not (1 <= args.min_nproc <= args.nproc
                                           and args.max_restarts > 0):
        raise MeshtronError(f"--min-nproc {args.min_nproc} needs 1 <= it <= --nproc "
                            f"{args.nproc} and --max-restarts above 0 (restarts on fewer ranks)")
    cfg = load_config(args.config, split_overrides(extra))  # before torch: errors are instant
    if os.environ.get("RANK", "0") == "0" and not os.environ.get("MESHTRON_LAUNCHER_PID"):
        for note in inert_settings(cfg):  # said once: by the launcher or a lone process
            print(f"note: {note}", file=sys.stderr)
    if args.max_restarts and not (cfg.checkpoint.resume and (cfg.checkpoint.every or
                                                             cfg.checkpoint.every_seconds)):
        raise MeshtronError(
            "--max-restarts needs checkpoints to restart from: set checkpoint.every (steps) or "
            "checkpoint.every_seconds, and keep checkpoint.resume=true")
    from meshtron.training.train_command import run_train

    return run_train(args, extra, cfg)
