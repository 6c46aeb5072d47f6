"""``meshtron preprocess``: text files to a Megatron-format indexed dataset (PREFIX.bin/.idx),
with a given tokenizer or a byte-level BPE trained on the same text.

The output prefix and its folder are checked before any text is read; numpy and the tokenizers
library are imported only once the command runs (``meshtron --help`` builds this parser)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshtron.config.checks import SANITY_LIMITS
from meshtron.config.parse import default_cache_dir
from meshtron.errors import MeshtronError
from meshtron.files import check_writable

MAX_VOCAB = SANITY_LIMITS["data.vocab_size"]
"""As data.vocab_size: the tokenizers library allocates ~70 bytes per entry up front and
aborts the process (a Rust panic, not an exception) when that fails."""


def add_preprocess_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("preprocess", help="tokenise text into an indexed dataset (.bin/.idx)")
    p.add_argument("inputs", nargs="+", help=".txt/.jsonl files or folders of them")
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx")
    p.add_argument("--tokenizer", help="tokenizer.json to use (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=8192, help="size of a trained tokenizer")
    p.add_argument("--cache-dir", help="where tokenizers are cached (default: "
                   "$XDG_CACHE_HOME/meshtron, else ~/.cache/meshtron)")
    p.set_defaults(func=run_preprocess)
    return p


def run_preprocess(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.data.preprocessing import preprocess
    from meshtron.data.sources import open_source
    from meshtron.data.tokenizer import MIN_VOCAB, Tokenizer, train_tokenizer

    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    if not Path(args.output).name or args.output.endswith(("/", ".")):
        raise MeshtronError(f"--output {args.output!r} names no file prefix (PREFIX.bin and "
                            "PREFIX.idx are written)")
    if not args.tokenizer and not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        raise MeshtronError(f"--vocab-size {args.vocab_size} is outside what a trained "
                            f"tokenizer may have ({MIN_VOCAB} to {MAX_VOCAB:,})")
    check_writable(Path(args.output).parent, "--output's folder")
    sources = [open_source(path) for path in args.inputs]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        cache_dir = os.path.expanduser(args.cache_dir or default_cache_dir())
        tokenizer = train_tokenizer(sources, args.vocab_size, cache_dir,
                                    show_progress=sys.stderr.isatty())
        print(f"tokenizer: {tokenizer.path}")
    stats = preprocess(sources, args.output, tokenizer)
    print(f"wrote {args.output}.bin/.idx: {stats['documents']} documents, {stats['tokens']} "
          f"tokens, {stats['mb_per_s']:.1f} MB/s; tokenizer {stats['tokenizer']}")
    print(f"train on it with: meshtron train --data.path={args.output}")
    return 0
