"""``meshtron convert``: a Hugging Face folder or a GGUF file to a meshtron checkpoint, or a
meshtron run or checkpoint to either (:mod:`.gguf_convert` dispatches on the kind of --from).

The destination is probed for writability first; the converters (torch, safetensors, gguf)
are imported only once the command runs (``meshtron --help`` builds this parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtron.errors import MeshtronError
from meshtron.files import check_writable, special_kind


def add_convert_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
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
    p.set_defaults(func=run_convert)
    return p


def run_convert(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    src, dst = Path(args.src), Path(args.dst)
    if (kind := special_kind(src)) is not None:
        raise MeshtronError(f"--from {src} is {kind}, not a checkpoint, run, GGUF file or folder")
    place = next(p for p in (dst, *dst.parents) if p.exists())  # a failed convert leaves no --to
    check_writable(place, "--to" if place == dst else f"--to {dst}: the folder")
    from meshtron.checkpoint.gguf_convert import convert

    result = convert(src, dst, args.format, args.gguf_type)
    for note in result.notes:
        print(f"note: {note}")
    print(f"wrote {result.output}")
    return 0
