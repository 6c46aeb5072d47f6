"""The ``meshtron serve`` command line: its flags and help, without importing torch or the web
stack (so that ``meshtron --help`` stays instant); :mod:`.serve_command` runs it."""

from __future__ import annotations

import argparse

from meshtron.config.parse import split_overrides
from meshtron.inference.generate_arguments import check_sampling, sampling_arguments

SERVE_EPILOG = """\
POST /v1/completions (OpenAI's API: prompt, max_tokens, temperature, top_p, top_k, stop, stream,
seed), POST /v1/chat/completions (messages, rendered with the model's chat template, and the same
fields), GET /v1/models, GET /health: see docs/inference.md. A request without temperature,
top_k or top_p gets the flag's value, else the model's (as for generate; said at start-up).
Config fields as for generate: --parallel.tp, --parallel.pp, --parallel.pp_layers,
--precision.dtype."""


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    overrides = split_overrides(extra)
    check_sampling(args)
    from meshtron.inference.serve_command import run_serve

    return run_serve(args, overrides)


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="serve a checkpoint over HTTP (OpenAI-style /v1/completions)",
        description="Serve a checkpoint's model over HTTP: rank 0 answers, the other ranks "
        "of a tp x pp replica follow it;\nrequests that arrive together run as one batch. "
        "Needs the serve extra (pip install meshtron[serve]).",
        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="a run directory, a checkpoint directory, or one step_* inside it")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free one")
    p.add_argument("--nproc", type=int, default=1,
                   help="local processes, tp x pp of them (default 1)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="most prompts generated together in one batch (default 16)")
    p.add_argument("--model-name",
                   help="the model's name in responses (default: the --checkpoint folder's)")
    p.add_argument("--access-log", action="store_true", help="log every request (uvicorn's)")
    sampling_arguments(p, " for requests that do not set it")
    p.set_defaults(func=cmd_serve)
    return p
