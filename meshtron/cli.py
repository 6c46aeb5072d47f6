"""``meshtron <command>``: find the command, run it, turn user errors into one line.

Each command is a module in the package of what it does (its flags and help beside it, or in
a sibling ``*_arguments.py`` where the command itself imports torch); :data:`COMMANDS` lists
them, in the order ``meshtron --help`` shows. Their parsers import nothing heavy, so that
``meshtron --help`` and config errors are instant; each command imports what it runs on once
it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable

from meshtron.archsearch.archsearch_arguments import add_archsearch_parser
from meshtron.checkpoint.convert_command import add_convert_parser
from meshtron.data.preprocess_command import add_preprocess_parser
from meshtron.data.sample_data_command import add_sample_data_parser
from meshtron.data.vla_data_command import add_vla_data_parser
from meshtron.errors import MeshtronError
from meshtron.files import REASONS as OS_REASONS
from meshtron.files import os_reason
from meshtron.hpsearch.hpsearch_arguments import add_hpsearch_parser
from meshtron.inference.evaluate_arguments import add_evaluate_parser
from meshtron.inference.generate_arguments import add_generate_parser
from meshtron.inference.serve_arguments import add_serve_parser
from meshtron.parallel.pipeline.schedule_command import add_schedule_parser
from meshtron.signals import Stopped, report_stop, stop_on_signals
from meshtron.training.plot_command import add_plot_parser
from meshtron.training.train_arguments import add_train_parser
from meshtron.tune.tune_arguments import add_tune_parser

AddParser = Callable[[argparse._SubParsersAction], argparse.ArgumentParser]

COMMANDS: dict[str, AddParser] = {
    "train": add_train_parser,  # training/train_arguments.py, train_command.py
    "preprocess": add_preprocess_parser,  # data/preprocess_command.py
    "sample-data": add_sample_data_parser,  # data/sample_data_command.py
    "generate": add_generate_parser,  # inference/generate_arguments.py, generate_command.py
    "serve": add_serve_parser,  # inference/serve_arguments.py, serve_command.py
    "tune": add_tune_parser,  # tune/tune_arguments.py, tune_command.py
    "hpsearch": add_hpsearch_parser,  # hpsearch/hpsearch_arguments.py, hpsearch_command.py
    "archsearch": add_archsearch_parser,  # archsearch/archsearch_arguments.py, ..._command.py
    "vla-data": add_vla_data_parser,  # data/vla_data_command.py
    "evaluate": add_evaluate_parser,  # inference/evaluate_arguments.py, evaluate_command.py
    "plot": add_plot_parser,  # training/plot_command.py
    "schedule": add_schedule_parser,  # parallel/pipeline/schedule_command.py
    "convert": add_convert_parser,  # checkpoint/convert_command.py
}
"""Every ``meshtron`` command: its name and what adds its parser, whose ``func`` runs it as
``func(args, unparsed) -> exit code``."""


class _Parser(argparse.ArgumentParser):
    """argparse, its errors in meshtron's one-line form (``meshtron: error: ...``)."""

    def error(self, message: str) -> typing.NoReturn:
        sys.stderr.write(f"meshtron: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="meshtron",
        description="Train transformer language models with tensor, sequence, pipeline, data, "
        "context and expert parallelism on one device mesh.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in COMMANDS.values():
        add_parser(sub)
    return parser


def _finish(code: int) -> int:
    """Return the exit code; a rank of a multi-process job leaves through ``exit_process``."""
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from meshtron.parallel.mesh.process import exit_process

            exit_process(code)
    return code


def _peer_failure(err: BaseException) -> str | None:
    """One line for a collective that failed because a peer died or stalled (see
    :mod:`meshtron.parallel.mesh.peer_failure`); None before torch is imported."""
    if "torch" not in sys.modules:
        return None
    from meshtron.parallel.mesh.peer_failure import peer_failure

    return peer_failure(err)


def _check_working_folder() -> None:
    """The current folder exists: in a deleted one, relative paths mean nothing and torch's
    import dies in oneMKL with a "FATAL ERROR" instead of an exception."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise MeshtronError("the current folder no longer exists (deleted or moved away); cd "
                            "to an existing folder and run the command again") from None


def main(argv: typing.Sequence[str] | None = None) -> int:
    with stop_on_signals() as received:  # first thing: a rank may be stopped while it starts
        command = None
        try:
            args, extra = build_parser().parse_known_args(argv)
            command = args.command
            _check_working_folder()
            code = args.func(args, extra)
            received.disarm()
        except (Stopped, KeyboardInterrupt) as err:
            received.disarm()
            code = report_stop(err, training=command == "train")
        except Exception as err:
            received.disarm()
            if received.signum is not None:  # e.g. a collective whose peer the signal stopped
                code = report_stop(Stopped(received.signum), training=command == "train")
            elif isinstance(err, MeshtronError):
                sys.stdout.flush()
                print(f"meshtron: error: {err}", file=sys.stderr)
                code = 2
            elif isinstance(err, OSError) and err.errno in OS_REASONS:
                name = str(err.filename or "")
                where = f" ({name[:80]}{'...' if len(name) > 80 else ''})" if name else ""
                print(f"meshtron: error: the file system refused a write or read{where}: "
                      f"{os_reason(err)}", file=sys.stderr)
                code = 2
            elif (message := _peer_failure(err)) is not None:
                print(f"meshtron: error: {message}", file=sys.stderr)
                code = 1
            else:
                raise
    return _finish(code)
