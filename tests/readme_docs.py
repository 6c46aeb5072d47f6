"""Which commands of docs/*.md tests/test_readme.py runs, and why it leaves the others out.

The docs' commands run after the README's, in the same clone: they use its runs
(``runs/default``, ``runs/mine``), files (``corpus.txt``, ``arch.yaml``) and imports
(``ckpt/smollm2``). What is not run is either not runnable on one machine in a test (servers,
several machines, incomplete examples), the README's own command again, or minutes long.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

DUPLICATE = "the README runs this command (or the same with other names)"
LONG = "minutes long; the README runs a shorter command of the same kind"
BENCHMARK = "a benchmark: minutes to hours, run by hand (its results are in the docs)"
SEVERAL_MACHINES = "needs several machines (or SLURM)"
INCOMPLETE = "an incomplete example: `...` stands for the rest of the command"
SERVER = "a server runs until it is stopped (tests/test_serve.py serves and asks it)"

DOCS_NOT_RUN: dict[tuple[str, str], str] = {
    ("archsearch.md", "meshtron archsearch --budget-flops 4e12"): DUPLICATE,
    ("archsearch.md", "meshtron archsearch --budget-gpu-hours"): "prices every shape on the 64-GPU "
        "cluster's cost model: over 8 minutes here; the README's archsearch runs the same search",
    ("archsearch.md", ".venv/bin/python benchmarks/"): BENCHMARK,
    ("context_parallel.md", "meshtron train --nproc 4 --parallel.cp=4 "): DUPLICATE,
    ("context_parallel.md", "meshtron train --nproc 4 --model.preset=tiny-long"): DUPLICATE,
    ("finetuning.md", "meshtron convert --from smollm2.gguf --to ckpt/chat-base"): DUPLICATE,
    ("finetuning.md", "meshtron train --config ckpt/chat-base/train.yaml"): "fine-tunes the "
        "real 135M model (1-6 minutes here); tests/test_chat_serve.py trains on conversations",
    ("finetuning.md", "meshtron serve"): SERVER,
    ("finetuning.md", "curl"): "asks the server above",
    ("hpsearch.md", "meshtron hpsearch"): DUPLICATE,
    ("hpsearch.md", ".venv/bin/python benchmarks/"): BENCHMARK,
    ("inference.md", "meshtron generate --checkpoint ckpt/smollm2"): "two minutes of the real "
        "model's decoding here; the README generates from ckpt/smollm2 (at tp=3)",
    ("inference.md", "pip install"): "installs packages; the environment has the serve extra",
    ("inference.md", "meshtron serve"): SERVER,
    ("inference.md", "torchrun --nproc-per-node 2 -m meshtron serve"): SERVER,
    ("inference.md", "curl"): "asks the server above",
    ("moe.md", "meshtron train --model.preset=tiny-moe --run.dir"): DUPLICATE,
    ("moe.md", "meshtron train --nproc 4 --model.preset=tiny-moe --parallel.ep=2"): DUPLICATE,
    ("parallelism.md", "meshtron train --nproc 4 --parallel.tp=2 ..."): INCOMPLETE,
    ("parallelism.md", "torchrun --nproc-per-node 4"): INCOMPLETE,
    ("parallelism.md", "torchrun --nnodes"): SEVERAL_MACHINES,
    ("parallelism.md", "export"): SEVERAL_MACHINES,
    ("parallelism.md", "srun"): SEVERAL_MACHINES,
    ("reliability.md", ".venv/bin/python benchmarks/"): BENCHMARK,
    ("reliability.md", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun"): SEVERAL_MACHINES,
    ("tuning.md", "meshtron tune --calibrate"): "three minutes of measuring this machine here "
        "(tests/test_calibrate.py calibrates in its quick mode)",
    ("tuning.md", "meshtron train --nproc"): "needs here.json, the calibration above "
        "(tests/test_autotune.py trains with train.autotune)",
    ("training.md", "meshtron train --model.mup=true --model.mup_base_width=256 "
                    "--model.hidden_size=2048"): LONG,
    ("training.md", "meshtron plot runs/default runs/mine"): DUPLICATE,
    ("training.md", "meshtron train --config ckpt/smollm2/train.yaml --data.path=chat.jsonl"):
        "LoRA on the real model over a chat file: minutes here (tests/test_lora.py trains, "
        "resumes, merges and exports adapters on the test model)",
    ("training.md", "meshtron generate --checkpoint runs/lora/ckpt"): "needs the LoRA run above",
    ("training.md", "meshtron convert --from runs/lora/ckpt"): "needs the LoRA run above",
}
"""(doc, how the command starts) -> why tests/test_readme.py does not run it."""


def docs_commands(docs: Path, commands: Callable[[str, str], list[list[str]]]
                  ) -> list[tuple[str, list[str]]]:
    """(doc name, argument list) of every command in the ``bash`` and ``sh`` blocks of the
    docs, doc by doc in name order (``commands`` reads one doc's text)."""
    return [(path.name, words) for path in sorted(docs.glob("*.md"))
            for words in commands(path.read_text(), "bash|sh")]


def not_run_reason(doc: str, words: list[str]) -> str | None:
    """Why the command is not run, or None when it is."""
    line = " ".join(words)
    return next((reason for (name, start), reason in DOCS_NOT_RUN.items()
                 if name == doc and line.startswith(start)), None)
