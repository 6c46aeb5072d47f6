"""``meshtron <command>``: parse arguments, call the layers below, turn user errors into one line.

Commands: ``train``, ``preprocess``, ``generate``, ``serve``, ``tune``, ``hpsearch``,
``archsearch``, ``vla-data``, ``evaluate``, ``plot``, ``schedule``, ``convert``. Heavy imports
(torch and friends) happen inside each command so that ``meshtron --help`` and config errors
are instant.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import typing
from pathlib import Path

from meshtron.archsearch.archsearch_arguments import add_archsearch_parser
from meshtron.config.docs import config_reference
from meshtron.config.parse import split_overrides as _split_overrides
from meshtron.errors import MeshtronError
from meshtron.files import REASONS as OS_REASONS
from meshtron.files import check_writable, os_reason
from meshtron.hpsearch.hpsearch_arguments import add_hpsearch_parser
from meshtron.inference.vla_arguments import add_vla_parsers
from meshtron.signals import Stopped, report_stop, stop_on_signals
from meshtron.tune.tune_arguments import add_tune_parser

if typing.TYPE_CHECKING:
    from meshtron.config import Config
    from meshtron.parallel.mesh.process import ProcessInfo


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.config import load_config

    if args.nproc < 1:
        raise MeshtronError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise MeshtronError(f"--max-restarts must not be negative, got {args.max_restarts}")
    if args.min_nproc is not None and not (1 <= args.min_nproc <= args.nproc
                                           and args.max_restarts > 0):
        raise MeshtronError(f"--min-nproc {args.min_nproc} needs 1 <= it <= --nproc "
                            f"{args.nproc} and --max-restarts above 0 (restarts on fewer ranks)")
    cfg = load_config(args.config, _split_overrides(extra))  # before torch: errors are instant
    if args.max_restarts and not (cfg.checkpoint.resume and (cfg.checkpoint.every or
                                                             cfg.checkpoint.every_seconds)):
        raise MeshtronError(
            "--max-restarts needs checkpoints to restart from: set checkpoint.every (steps) or "
            "checkpoint.every_seconds, and keep checkpoint.resume=true")

    from meshtron.costmodel.online import running_prices
    from meshtron.parallel.mesh.process import LAUNCHER_ENV, process_info
    from meshtron.plan import check_run
    from meshtron.training.autotune import with_chosen_layout
    from meshtron.training.run_dir import check_run_dir

    info = process_info()
    launching = (args.nproc > 1 or args.max_restarts > 0) and not info.distributed
    cfg = with_chosen_layout(cfg)  # train.autotune=layout: what an earlier start chose
    if cfg.train.autotune == "layout" and not (launching or os.environ.get(LAUNCHER_ENV)):
        raise MeshtronError("train.autotune=layout starts the ranks again in the new layout "
                            "through meshtron's launcher: run meshtron train --nproc N")
    try:  # before any process group
        world_size = args.nproc if launching else info.world_size
        check_run(cfg, world_size)
        check_run_dir(cfg)
        _check_state_fits(cfg, world_size)
        running_prices(cfg, world_size)  # train.autotune_profile loads
    except MeshtronError:
        if info.distributed and info.rank != 0:
            return 2  # every rank sees the same config and files: rank 0 says it once
        raise
    from meshtron.training.run_lock import run_lock

    holder = not info.distributed or info.rank == 0  # the launcher, or rank 0 under torchrun
    with run_lock(Path(cfg.run.dir), cfg.checkpoint_dir) if holder else contextlib.nullcontext():
        return _launch_or_train(args, extra, cfg, info, launching)


def _check_state_fits(cfg: Config, world_size: int) -> None:
    """The model's training state fits this machine's memory (before any process starts)."""
    import torch

    from meshtron.parallel.mesh import MeshLayout
    from meshtron.training.memory import check_state_fits

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    check_state_fits(cfg, MeshLayout.of(cfg.parallel, world_size), device)


def _layout_fits(cfg: Config, world_size: int) -> bool:
    """The plan accepts ``world_size`` ranks (a candidate for continuing on fewer)."""
    from meshtron.plan import check_run

    try:
        check_run(cfg, world_size)
    except MeshtronError:
        return False
    return True


def _launch_or_train(args: argparse.Namespace, extra: list[str], cfg: Config,
                     info: ProcessInfo, launching: bool) -> int:
    if launching:
        from meshtron.parallel.mesh.launch import launch_local

        forwarded = (["--config", args.config] if args.config else []) + extra
        return launch_local(args.nproc, forwarded, args.max_restarts, args.min_nproc,
                            fits=lambda world: _layout_fits(cfg, world))

    from meshtron.parallel.mesh import MeshLayout, ParallelMesh
    from meshtron.parallel.mesh.launch import RELAYOUT_EXIT_CODE
    from meshtron.parallel.mesh.process import device_for, die_with_launcher, init_process_group
    from meshtron.training.trainer import train

    die_with_launcher()
    init_process_group(info, cfg.run.timeout_s)
    mesh = ParallelMesh(MeshLayout.of(cfg.parallel, info.world_size), info.rank)
    result = train(cfg, mesh, device=device_for(info))
    if result.relayout is not None:  # train.autotune=layout: the launcher starts us again
        return RELAYOUT_EXIT_CODE
    if info.rank != 0:
        return 0
    if result.losses:
        summary = (f"trained steps {result.start_step}..{result.end_step}: loss "
                   f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
        if result.val_loss is not None:
            import math

            summary += (f"; validation loss {result.val_loss:.4f}, perplexity "
                        f"{math.exp(result.val_loss):.2f}")
        print(summary)
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}")
    print(f"run directory: {result.run_dir}")
    return 0


def cmd_preprocess(args: argparse.Namespace, extra: list[str]) -> int:

    from meshtron.data import Tokenizer, open_source, preprocess, train_tokenizer

    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    if not Path(args.output).name or args.output.endswith(("/", ".")):
        raise MeshtronError(f"--output {args.output!r} names no file prefix (PREFIX.bin and "
                            "PREFIX.idx are written)")
    check_writable(Path(args.output).parent, "--output's folder")
    sources = [open_source(path) for path in args.inputs]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        tokenizer = train_tokenizer(sources, args.vocab_size, os.path.expanduser(args.cache_dir))
        print(f"tokenizer: {tokenizer.path}")
    stats = preprocess(sources, args.output, tokenizer)
    print(f"wrote {args.output}.bin/.idx: {stats['documents']} documents, {stats['tokens']} "
          f"tokens, {stats['mb_per_s']:.1f} MB/s; tokenizer {stats['tokenizer']}")
    print(f"train on it with: meshtron train --data.path={args.output}")
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    overrides = _split_overrides(extra)
    _check_sampling(args)
    from meshtron.inference.generate_command import run_generate

    return run_generate(args, overrides)


def cmd_tune(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.tune.tune_command import run_tune

    return run_tune(args, extra)


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    overrides = _split_overrides(extra)
    _check_sampling(args)
    from meshtron.inference.serve_command import run_serve

    return run_serve(args, overrides)


def _check_sampling(args: argparse.Namespace) -> None:
    """Sampling settings that make sense, refused with one line before anything loads."""
    import math

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


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    runs = [Path(r) for r in args.runs]
    default = runs[0] / "loss.png" if len(runs) == 1 else Path("loss.png")
    out = _png_path(args.output, "loss.png") if args.output else default
    if all(run.is_dir() for run in runs):  # a run that is not one is plot_runs' to report
        check_writable(out.parent, f"{'--output ' if args.output else ''}{out}: the folder")
    from meshtron.training.plot import plot_runs

    print(plot_runs(runs, out))
    return 0


def _png_path(given: str, default_name: str) -> Path:
    """Where a PNG goes: inside ``given`` when it is a directory, with ``.png`` added when it
    names no extension (matplotlib would add it without saying so)."""
    path = Path(given)
    if path.is_dir():
        return path / default_name
    return path if path.suffix else path.with_name(path.name + ".png")


SCHEDULE_LIMITS = {"pp": 256, "vpp": 16, "microbatches": 4096}
"""What `meshtron schedule` simulates and draws (larger tables take minutes and gigabytes)."""


def cmd_schedule(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    from meshtron.parallel.pipeline.schedules import COMM_KINDS, build_schedule
    from meshtron.parallel.pipeline.timeline import plot_schedule

    for name, limit in SCHEDULE_LIMITS.items():
        if getattr(args, name) > limit:
            raise MeshtronError(f"--{name} {getattr(args, name)} is beyond what `meshtron "
                                f"schedule` simulates and draws (at most {limit})")
    if args.pp * args.vpp * args.microbatches > 65536:
        raise MeshtronError(f"--pp x --vpp x --microbatches = "
                            f"{args.pp * args.vpp * args.microbatches} actions per pass is beyond "
                            "what `meshtron schedule` simulates and draws (at most 65536)")
    schedule = build_schedule(args.schedule, args.pp, args.vpp, args.microbatches)
    print(f"schedule {schedule.name}: pp={schedule.pp} vpp={schedule.vpp} "
          f"micro-batches={schedule.microbatches}")
    print("\n".join(schedule.table()))
    comm = [a for row in schedule.stages for a in row if a.kind in COMM_KINDS]
    sends = sum(a.kind.startswith("SEND") for a in comm)
    print(f"communication: {sends} sends and {len(comm) - sends} receive posts "
          f"(not shown above), each posted {schedule.receives_ahead} ahead")
    costs = ", ".join(f"{k}={v:g}" for k, v in schedule.default_costs().items())
    print(f"bubble fraction ({costs}): theory {schedule.theoretical_bubble():.4f}, "
          f"simulated {schedule.bubble_fraction():.4f}")
    unit = "(micro-batch, chunk) pairs" if schedule.vpp > 1 else "micro-batches"
    print(f"peak in-flight {unit} per stage: "
          + " ".join(str(n) for n in schedule.peak_in_flight()))
    default = (f"schedule-{schedule.name}-pp{schedule.pp}-vpp{schedule.vpp}"
               f"-m{schedule.microbatches}.png")
    out = _png_path(args.out, default) if args.out else Path(default)
    print(f"timeline: {plot_schedule(schedule, out)}")
    return 0


def cmd_convert(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    dst = Path(args.dst)
    place = next(p for p in (dst, *dst.parents) if p.exists())  # a failed convert leaves no --to
    check_writable(place, "--to" if place == dst else f"--to {dst}: the folder")
    from meshtron.checkpoint.gguf_convert import convert

    result = convert(Path(args.src), dst, args.format, args.gguf_type)
    for note in result.notes:
        print(f"note: {note}")
    print(f"wrote {result.output}")
    return 0


GENERATE_EPILOG = """\
config fields (as --section.field=value; the model comes from the checkpoint):
  --parallel.tp (default 1): tensor-parallel ranks (heads, kv heads, FFN, vocabulary)
  --parallel.pp (default 1): pipeline stages, each keeping the KV cache of its layers
  --parallel.pp_layers (default None): layers per stage, as in training
  --precision.dtype (default: as the checkpoint was saved): fp32, bf16, fp16 or fp64
Unset, --temperature, --top-k, --top-p and --max-new-tokens are the model's (its generation
settings: an imported model's generation_config.json, greedy when it has none). On stderr: the
sampling used and where it came from, then tokens/s and the time to the first token."""

SERVE_EPILOG = """\
POST /v1/completions (OpenAI's API: prompt, max_tokens, temperature, top_p, top_k, stop, stream,
seed), GET /v1/models, GET /health: see docs/inference.md. A request without temperature,
top_k or top_p gets the flag's value, else the model's (as for generate; said at start-up).
Config fields as for generate: --parallel.tp, --parallel.pp, --parallel.pp_layers,
--precision.dtype."""


def _sampling_arguments(p: argparse.ArgumentParser, scope: str = "") -> None:
    """--temperature, --top-k, --top-p: unset, the model's generation settings decide."""
    p.add_argument("--temperature", type=float, help=f"0 is greedy{scope} (default: the model's "
                   "generation config: its temperature when it samples, 0 when it does not or "
                   "states nothing, as transformers; a model meshtron trained: 0.8)")
    p.add_argument("--top-k", type=int, help=f"0 disables top-k filtering{scope} (default: the "
                   "model's, else 50 as transformers; a model meshtron trained: 50)")
    p.add_argument("--top-p", type=float, help=f"1 disables nucleus filtering{scope} (default: "
                   "the model's, else 1.0 as transformers; a model meshtron trained: 0.95)")


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

    p = sub.add_parser(
        "train", help="train a model (resumes from the newest checkpoint)",
        description="Train a model. Settings come from the defaults, then --config, then "
        "--section.field=value overrides.",
        epilog=config_reference(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML file with config sections")
    p.add_argument("--nproc", type=int, default=1, help="number of local processes (default 1)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="when a rank fails, restart every rank from the newest checkpoint, up "
                   "to R times (default 0)")
    p.add_argument("--min-nproc", type=int, default=None, metavar="M",
                   help="with --max-restarts: continue each restart on fewer ranks (the "
                   "largest count the layout accepts, down to M), resharding the checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("preprocess", help="tokenise text into an indexed dataset (.bin/.idx)")
    p.add_argument("inputs", nargs="+", help=".txt/.jsonl files or folders of them")
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx")
    p.add_argument("--tokenizer", help="tokenizer.json to use (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=8192, help="size of a trained tokenizer")
    p.add_argument("--cache-dir", default="~/.cache/meshtron", help="where tokenizers are cached")
    p.set_defaults(func=cmd_preprocess)

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
    _sampling_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="of the sampling (default 0)")
    p.set_defaults(func=cmd_generate)

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
    _sampling_arguments(p, " for requests that do not set it")
    p.set_defaults(func=cmd_serve)

    add_tune_parser(sub).set_defaults(func=cmd_tune)
    add_hpsearch_parser(sub)
    add_archsearch_parser(sub)
    add_vla_parsers(sub)

    p = sub.add_parser("plot", help="plot loss curves of one or more runs to a PNG")
    p.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    p.add_argument("--output", help="PNG path (default: RUN/loss.png, or ./loss.png for several)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("schedule", help="show a pipeline schedule, its bubble, and a timeline PNG")
    p.add_argument("--schedule", default="1f1b",
                   help="gpipe, 1f1b, interleaved, zb-h1 or zb-v")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--vpp", type=int, default=1,
                   help="model chunks per stage: >= 2 for interleaved, 2 for zb-v (default 1)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--out", help="PNG path (default: ./schedule-S-ppP-vppV-mM.png)")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser(
        "convert", help="convert between meshtron checkpoints, Hugging Face models and GGUF",
        description="Convert a Hugging Face model folder (config.json + safetensors; Llama, "
        "Mistral, Mixtral, GPT-2) or a GGUF file (llama.cpp; llama, qwen2, qwen3, gpt2) to a "
        "meshtron checkpoint, or a meshtron run or checkpoint to a Hugging Face folder or a "
        "GGUF file. The kind of --from is detected.",
    )
    p.add_argument("--from", dest="src", required=True, help="a Hugging Face model folder, a "
                   ".gguf file, or a meshtron run / checkpoint directory")
    p.add_argument("--to", dest="dst", required=True,
                   help="output folder (new or empty), or the new .gguf file for --format gguf")
    p.add_argument("--format", default="meshtron",
                   help="output format: meshtron (default), hf or gguf")
    p.add_argument("--gguf-type", help="with --format gguf, how matrices are stored: f32 "
                   "(default), f16, bf16 or q8_0 (vectors stay f32)")
    p.set_defaults(func=cmd_convert)
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


def main(argv: typing.Sequence[str] | None = None) -> int:
    with stop_on_signals() as received:  # first thing: a rank may be stopped while it starts
        command = None
        try:
            args, extra = build_parser().parse_known_args(argv)
            command = args.command
            code = args.func(args, extra)
        except (Stopped, KeyboardInterrupt) as err:
            code = report_stop(err, training=command == "train")
        except Exception as err:
            if received.signum is not None:  # e.g. a collective whose peer the signal stopped
                code = report_stop(Stopped(received.signum), training=command == "train")
            elif isinstance(err, MeshtronError):
                sys.stdout.flush()
                print(f"meshtron: error: {err}", file=sys.stderr)
                code = 2
            elif isinstance(err, OSError) and err.errno in OS_REASONS:
                where = f" ({err.filename})" if err.filename else ""
                print(f"meshtron: error: the file system refused a write or read{where}: "
                      f"{os_reason(err)}", file=sys.stderr)
                code = 2
            elif (message := _peer_failure(err)) is not None:
                print(f"meshtron: error: {message}", file=sys.stderr)
                code = 1
            else:
                raise
    return _finish(code)
