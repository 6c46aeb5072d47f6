"""The ``meshtron generate`` command line: its flags, help and the sampling checks made before
anything loads, without importing torch (so that ``meshtron --help`` stays instant);
:mod:`.generate_command` runs it. ``serve`` shares the sampling flags and their checks."""

from __future__ import annotations

import argparse
import math

from meshtron.config.parse import split_overrides
from meshtron.errors import MeshtronError

GENERATE_EPILOG = """\
config fields (as --section.field=value; the model comes from the checkpoint):
  --parallel.tp (default 1): tensor-parallel ranks (heads, kv heads, FFN, vocabulary)
  --parallel.pp (default 1): pipeline stages, each keeping the KV cache of its layers
  --parallel.pp_layers (default None): layers per stage, as in training
  --precision.dtype (default: as the checkpoint was saved): fp32, bf16, fp16 or fp64
Unset, --temperature, --top-k, --top-p and --max-new-tokens are the model's (its generation
settings: an imported model's generation_config.json, greedy when it has none). On stderr: the
sampling used and where it came from, then tokens/s and the time to the first token."""


def sampling_arguments(p: argparse.ArgumentParser, scope: str = "") -> None:
    """--temperature, --top-k, --top-p: unset, the model's generation settings decide."""
    p.add_argument("--temperature", type=float, help=f"0 is greedy{scope} (default: the model's "
                   "generation config: its temperature when it samples, 0 when it does not or "
                   "states nothing, as transformers; a model meshtron trained: 0.8)")
    p.add_argument("--top-k", type=int, help=f"0 disables top-k filtering{scope} (default: the "
                   "model's, else 50 as transformers; a model meshtron trained: 50)")
    p.add_argument("--top-p", type=float, help=f"1 disables nucleus filtering{scope} (default: "
                   "the model's, else 1.0 as transformers; a model meshtron trained: 0.95)")


def check_sampling(args: argparse.Namespace) -> None:
    """Sampling settings that make sense, refused with one line before anything loads."""
    if getattr(args, "max_new_tokens", None) is not None and args.max_new_tokens < 0:
        raise MeshtronError(f"--max-new-tokens must not be negative, got {args.max_new_tokens}")
    if args.temperature is not None and not (math.isfinite(args.temperature)
                                             and args.temperature >= 0):
        raise MeshtronError(f"--temperature must be a finite number >= 0 (0 is greedy), got "
                            f"{args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise MeshtronError(f"--top-k must not be negative (0 disables it), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise MeshtronError(f"--top-p must lie in (0, 1] (1 disables it), got {args.top_p}")
    if getattr(args, "seed", None) is not None and not -(2**63) <= args.seed < 2**64:
        raise MeshtronError(f"--seed must fit in 64 bits, got {args.seed}")


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    overrides = split_overrides(extra)
    check_sampling(args)
    from meshtron.inference.generate_command import run_generate

    return run_generate(args, overrides)


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate", help="sample text from a checkpoint (batched, on tp x pp ranks)",
        description="Continue prompts with a checkpoint's model, all prompts in one batch. "
        "The checkpoint may have been saved under any layout: each rank reads only its part.",
        epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="a run directory, a checkpoint directory, or one step_* inside it")
    p.add_argument("--prompt", action="append",
                   help="text to continue; repeat for several prompts (default: one empty one)")
    p.add_argument("--prompt-file", help="more prompts, one per line")
    p.add_argument("--stop", action="append",
                   help="end a sequence at this text (repeatable; the text is cut before it)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (prompt, text, tokens, finish_reason)")
    p.add_argument("--nproc", type=int, default=1,
                   help="local processes, tp x pp of them (default 1)")
    p.add_argument("--max-new-tokens", type=int,
                   help="per prompt (default: the model's generation max_new_tokens, else 100)")
    sampling_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="of the sampling (default 0)")
    p.set_defaults(func=cmd_generate)
    return p
