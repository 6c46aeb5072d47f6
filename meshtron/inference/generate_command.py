"""``meshtron generate``: text from a checkpoint, on one process or one tp x pp model replica.

Everything a user can get wrong is checked before any process starts: the checkpoint and its
tokenizer, the layout its model is split into (tp dividing heads, kv heads, the FFN and the
vocabulary; the ranks being tp x pp), the dtype, every prompt fitting the model's positions.
With ``--nproc N`` the command then starts N ranks of itself through torch's elastic agent
(the same path as ``meshtron train --nproc``); under torchrun each rank is started already.
Every rank builds its pipeline stage for its tp rank, reads only its boxes of the weights
(whatever layout saved them), and generates; rank 0 prints. Sampling follows the model's
generation settings unless a flag says otherwise (:mod:`.sampling_defaults`); rank 0 says which
on stderr before generating.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from meshtron.checkpoint.loading import InferenceCheckpoint, load_model, open_for_inference
from meshtron.config import Config, GenerationConfig, config_from_dict, parse_override
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.inference.sampling_defaults import DEFAULT_MAX_NEW_TOKENS, choose_sampling, end_ids
from meshtron.models.generation import Completion, GenerationStats, Generator, StopRule
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.mesh.process import ProcessInfo, process_info
from meshtron.plan import RunPlan, plan_generation

SETTINGS = ("parallel.tp", "parallel.pp", "parallel.pp_layers", "precision.dtype")
"""The config fields ``generate`` takes; the model and the rest come from the checkpoint."""
ONE_REPLICA = ("parallel.ep", "parallel.etp", "parallel.cp", "parallel.sp", "parallel.vpp")


def run_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    """The ``generate`` command, after the CLI has parsed its arguments."""
    if args.nproc < 1:
        raise MeshtronError(f"--nproc must be at least 1, got {args.nproc}")
    info = process_info()
    launching = args.nproc > 1 and not info.distributed
    try:  # before any process group: every rank sees the same files, rank 0 says it
        check_stops(args.stop)
        prompts = read_prompts(args.prompt, args.prompt_file)
        ckpt = open_for_inference(Path(args.checkpoint))
        check_run_model(Path(args.checkpoint), ckpt)
        cfg = generation_config(ckpt, overrides)
        plan = plan_generation(cfg, args.nproc if launching else info.world_size)
        encoded = [ckpt.tokenizer.encode(p) for p in prompts]
        check_prompts(encoded, cfg.model.max_seq_len)
    except MeshtronError:
        if info.distributed and info.rank != 0:
            return 2
        raise
    if launching:
        from meshtron.parallel.mesh.launch import launch_local

        return launch_local(args.nproc, forwarded(args, ckpt.path, overrides),
                            command="generate")
    return _generate_on_rank(args, info, ckpt, plan, prompts, encoded)


def read_prompts(given: list[str] | None, prompt_file: str | None) -> list[str]:
    """``--prompt`` (repeatable), then one prompt per line of ``--prompt-file``; none: the
    empty prompt (the model starts from EOS)."""
    prompts = list(given or [])
    for i, prompt in enumerate(prompts):
        check_text(prompt, f"--prompt {i + 1}" if len(prompts) > 1 else "--prompt")
    if prompt_file is not None:
        path = Path(prompt_file)
        if path.exists() and not path.is_file():  # a FIFO without a writer blocks forever
            raise MeshtronError(f"--prompt-file {path} is not a regular file (prompts are "
                                "read from a text file, one per line)")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise MeshtronError(f"--prompt-file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise MeshtronError(f"--prompt-file {path} is unreadable "
                                f"({type(err).__name__})") from None
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise MeshtronError(f"--prompt-file {path} holds no prompt (one per line)")
        prompts += lines
    return prompts or [""]


def check_text(text: str, what: str) -> None:
    """Command-line text is UTF-8: bytes that are not arrive as lone surrogates, which no
    tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = text[err.start].encode("utf-8", "surrogateescape")
        raise MeshtronError(f"{what} is not UTF-8 text (byte 0x{raw.hex()} at character "
                            f"{err.start + 1})") from None


def check_stops(stops: list[str] | None) -> None:
    """Stop strings are non-empty UTF-8 text, as a served request's ``stop``: an empty one is
    found in every text and would end each sequence after its first token."""
    for i, stop in enumerate(stops or []):
        what = f"--stop {i + 1}" if len(stops or []) > 1 else "--stop"
        if not stop:
            raise MeshtronError(f"{what} is empty: a stop string must be non-empty text")
        check_text(stop, what)


def check_run_model(given: Path, ckpt: InferenceCheckpoint) -> None:
    """A run directory's newest checkpoint holds the run's model (as resume requires): a
    checkpoint of another model copied into the run would otherwise generate unnoticed."""
    saved_path = given / "config.yaml"
    if (given / "meta.json").is_file() or not saved_path.is_file():
        return
    saved = yaml.safe_load(saved_path.read_text())  # read once already by open_for_inference
    run_model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(run_model, dict):
        return
    theirs = _flat(run_model, "model")
    differences = [f"{key}: {theirs[key]} -> {value}"
                   for key, value in _flat(ckpt.config.to_dict()["model"], "model").items()
                   if key != "model.preset" and key in theirs and theirs[key] != value]
    if differences:
        raise MeshtronError(f"the newest checkpoint {ckpt.path} holds another model than the "
                            f"run {given} trained ({'; '.join(differences[:3])}); pass it "
                            "itself as --checkpoint to generate from it")


def _flat(section: dict, prefix: str) -> dict[str, object]:
    """``{"model.moe.top_k": 2, ...}`` of a nested config section."""
    out: dict[str, object] = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def generation_config(ckpt: InferenceCheckpoint, overrides: list[str]) -> Config:
    """The checkpoint's config with the layout and dtype of this generation: one process and
    the saved dtype unless ``overrides`` (only :data:`SETTINGS`) say otherwise."""
    data = ckpt.config.to_dict()
    data["parallel"], data["precision"] = {}, {"dtype": ckpt.saved_dtype}
    for text in overrides:
        section, key, value = parse_override(text)
        name = f"{section}.{key}"
        if name in ONE_REPLICA:
            raise MeshtronError(
                f"--{name}: generation runs one model replica (dp = cp = 1, experts split over "
                "tp like the MLP, no sequence parallelism); set only --parallel.tp and "
                "--parallel.pp")
        if name not in SETTINGS:
            raise MeshtronError(f"`meshtron generate` takes --{', --'.join(SETTINGS)} (the model "
                                f"and everything else come from the checkpoint), not --{name}")
        data[section][key] = value
    return config_from_dict(data)


def check_prompts(encoded: list[list[int]], max_len: int) -> None:
    for i, tokens in enumerate(encoded):
        if len(tokens) >= max_len:
            which = f"prompt {i + 1}" if len(encoded) > 1 else "the prompt"
            raise MeshtronError(f"{which} takes {len(tokens)} tokens: the model has {max_len} "
                                "positions (model.max_seq_len) and needs one for a new token")


def forwarded(args: argparse.Namespace, checkpoint: Path, overrides: list[str]) -> list[str]:
    """The arguments every launched rank gets: this command's, pinned to the checkpoint the
    launcher checked (a newer one may appear meanwhile)."""
    out = ["--checkpoint", str(checkpoint), f"--seed={args.seed}"]
    given = {"max-new-tokens": args.max_new_tokens, "temperature": args.temperature,
             "top-k": args.top_k, "top-p": args.top_p}  # unset ones stay the model's
    out += [f"--{name}={value!r}" for name, value in given.items() if value is not None]
    out += [f"--prompt={p}" for p in args.prompt or []]
    out += [f"--prompt-file={args.prompt_file}"] if args.prompt_file is not None else []
    out += [f"--stop={s}" for s in args.stop or []]
    out += ["--json"] if args.json else []
    return out + overrides


def stop_rule(tokenizer: Tokenizer, stops: list[str]) -> StopRule | None:
    if not stops:
        return None
    return lambda tokens: any(s in tokenizer.decode(tokens) for s in stops)


def completion_text(tokenizer: Tokenizer, completion: Completion, stops: list[str]) -> str:
    """The new text, cut before the first stop string it holds."""
    text = tokenizer.decode(completion.tokens)
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def _generate_on_rank(args: argparse.Namespace, info: ProcessInfo, ckpt: InferenceCheckpoint,
                      plan: RunPlan, prompts: list[str], encoded: list[list[int]]) -> int:
    from meshtron.parallel.mesh.process import device_for, die_with_launcher, init_process_group
    from meshtron.precision.policy import cpu_low_precision_note

    cfg = plan.config
    rank0 = info.rank == 0
    if info.distributed:
        die_with_launcher()
        init_process_group(info, cfg.run.timeout_s)
    mesh = ParallelMesh(plan.layout, info.rank)
    device = device_for(info)
    model = load_model(ckpt, plan, mesh, cfg.precision.dtype, device)
    if rank0:
        print(f"checkpoint: {ckpt.path}", file=sys.stderr)  # once loaded: an error is one line
        slow = cpu_low_precision_note(cfg.precision.dtype, device)
        if slow:
            print(f"warning: {slow}", file=sys.stderr)
    gen = ckpt.config.generation
    choice = choose_sampling(gen, args.temperature, args.top_k, args.top_p, args.seed)
    max_new_tokens = max_new_tokens_of(args, gen)
    if rank0:
        print(choice.line, file=sys.stderr)
        _note_room(cfg, encoded, max_new_tokens)
    stops = list(args.stop or [])
    completions, stats = Generator(model, mesh).generate(
        encoded, max_new_tokens, choice.sampling, end_ids(gen, ckpt.tokenizer.eos_id),
        stop_rule(ckpt.tokenizer, stops))
    if rank0:
        _print(args, ckpt.tokenizer, prompts, completions, stops)
        print(_stats_line(stats, mesh), file=sys.stderr)
    return 0


def max_new_tokens_of(args: argparse.Namespace, gen: GenerationConfig) -> int:
    """``--max-new-tokens``, else the model's ``max_new_tokens``, else 100."""
    if args.max_new_tokens is not None:
        return int(args.max_new_tokens)
    return gen.max_new_tokens if gen.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS


def _note_room(cfg: Config, encoded: list[list[int]], max_new_tokens: int) -> None:
    longest = max(len(tokens) or 1 for tokens in encoded)
    room = cfg.model.max_seq_len - longest
    if max_new_tokens > room:
        which = "the prompt takes" if len(encoded) == 1 else "the longest prompt takes"
        print(f"note: the model has {cfg.model.max_seq_len} positions and {which} {longest}, "
              f"so at most {room} new tokens are generated (--max-new-tokens {max_new_tokens})",
              file=sys.stderr)


def _print(args: argparse.Namespace, tokenizer: Tokenizer, prompts: list[str],
           completions: list[Completion], stops: list[str]) -> None:
    """Each prompt and its continuation (several: separated by a ``---`` line), or with
    ``--json`` one JSON object per prompt and line."""
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        text = completion_text(tokenizer, completion, stops)
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "tokens": completion.tokens,
                              "finish_reason": completion.finish}))
        else:
            print(("---\n" if i else "") + prompt + text)


def _stats_line(stats: GenerationStats, mesh: ParallelMesh) -> str:
    layout = mesh.layout
    where = f" on tp={layout.tp} x pp={layout.pp}" if layout.world_size > 1 else ""
    return (f"generated {stats.new_tokens} tokens for {stats.prompts} prompt"
            f"{'s' if stats.prompts > 1 else ''}{where} in {stats.total_s:.2f} s: "
            f"{stats.tokens_per_s:.1f} tokens/s; first token after "
            f"{1000 * stats.first_token_s:.0f} ms, then {stats.decode_tokens_per_s:.1f} tokens/s")
