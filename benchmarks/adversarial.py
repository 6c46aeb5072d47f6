"""Adversarial pass: bad inputs and crafted checkpoints through every ``meshtron`` command.

Measures whether each refusal keeps the contract: a non-zero exit, stderr holding one ``meshtron:
error:`` line and otherwise only ``warning:`` lines (counted), no ``Traceback``, an exit within
``--timeout`` (else a hang: its process group is killed), no pickle payload run; exit 0 on a bad
input is a wrong success. Cases: bad config values, flags, YAML, data and metrics files for each
command, hostile Hugging Face folders, and attacks on the newest checkpoint of a real two-step
run, each through resume (``meshtron train``), ``generate`` and ``convert``. A few must succeed
(a ``.tmp-*`` leftover, an empty YAML, controls); an attack on what a command never reads accepts
either outcome. argparse usage errors are counted apart. Children get an 8 GiB address space.
From the repository root (tests the meshtron beside it; ~15 min on 2 cores; exit 1 on failure)::

    .venv/bin/python benchmarks/adversarial.py [--quick] [--only REGEX] [--list-failures]
        [--json OUT] [--workers 2] [--timeout 60]

W is a case's scratch directory, S the shared one (S/base: the real run, S/hf: its HF export).
Attacks: /json/pointer=VALUE edits the manifest (no =: drops it); -F deletes F, ~F flips a byte,
F=X replaces it (@G: garbage), F:KEY=nan|inf|f64|cut|OTHER|(empty: drop) rewrites a safetensors
tensor; a final ! re-signs F (a consistent forgery).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Setup = Callable[[Path], object]
TRAIN = ["train", "--model.preset=tiny", "--train.steps=2", "--train.seq_len=32",
         "--train.global_batch=2", "--train.eval_every=0", "--train.peak_flops=1e12",
         "--checkpoint.every=1", "--run.plot=false", "--run.progress=false",
         "--data.cache_dir=S/cache", "--run.dir=W/run"]
GARBAGE = random.Random(0).randbytes(4096) + b"\xff\xfe\x00garbage"
ROWS = "".join(json.dumps({"step": i, "loss": 9.0 - i / 10}) + "\n" for i in range(1, 6))
CONTENT: dict[str, bytes | str] = {
    "@G": GARBAGE, "@T": "def f(x):\n    return x + 1\n" * 400, "@R": ROWS, "@E": "",
    "@RT": ROWS + '{"step": 6, "lo', "@DEEP": "[" * 10**5 + "]" * 10**5,
    "@P": b"cos\nsystem\n(S'touch PWNED'\ntR."}  # a pickle that runs `touch PWNED` if loaded
FAILURES = ("traceback", "hang", "wrong-success", "bad-stderr", "refused-valid", "crashed",
            "pickle-ran", "setup-error")
EXPECT = {"E": "error", "K": "ok", "A": "either"}


@dataclass
class Case:
    category: str
    name: str
    argv: list[str]  # after `meshtron`; W/... and S/... are filled in when it runs
    setup: Setup | None = None
    expect: str = "error"  # error | ok | either


def sub(text: str, w: Path, s: Path) -> str:
    return re.sub(r"(?<![\w/.])([WS])(?=/)", lambda m: str(w if m[1] == "W" else s), text)


def put(path: Path, data: bytes | str) -> None:
    """Write ``path`` as a new file (never through a hard link into the shared run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def files(spec: dict[str, Any]) -> Setup:
    """Write ``spec`` (relative path: content; a path ending in / is a directory)."""
    return lambda w: [(w / rel).mkdir(parents=True, exist_ok=True) if rel.endswith("/") else
                      put(w / rel, sub(v, w, w) if isinstance(v, str) else v)
                      for rel, v in spec.items()]


def entries(text: str, category: str, prefix: list[str]) -> list[Case]:
    """Cases from '; '-separated entries: arguments, +FILE=CONTENT (an @ name of CONTENT, or
    text with \\n), +DIR/; a leading ! marks an input that must succeed."""
    cases = []
    for entry in (e.strip() for e in text.split(";") if e.strip()):
        tokens = shlex.split(entry.lstrip("!"))
        spec = {t[1:].partition("=")[0]: CONTENT.get(t.partition("=")[2], t.partition("=")[2]
                                                     .replace("\\n", "\n"))
                for t in tokens if t.startswith("+")}
        cases.append(Case(category, entry, [*prefix, *(t for t in tokens if t[0:1] != "+")],
                          files(spec), "ok" if entry.startswith("!") else "error"))
    return cases


def apply(d: Path, entry: str, manifest: str) -> None:
    """Apply an attack entry (space-separated operations, see the module docstring) to ``d``."""
    for op in entry.split():
        rel, eq, value = op.lstrip("-~").rstrip("!").partition("=")
        path = Path(os.path.normpath(d / rel.partition(":")[0]))
        if op.startswith("/"):  # a JSON pointer into the manifest (no =: drop that entry)
            data = node = json.loads((d / manifest).read_text())
            *keys, last = (k.replace("~1", "/").replace("~0", "~") for k in rel.split("/")[1:])
            for k in keys:
                node = node[int(k) if isinstance(node, list) else k]
            node.update({last: json.loads(value)}) if eq else node.pop(last)
            put(d / manifest, json.dumps(data))
        elif op.startswith("-"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        elif op.startswith("~"):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            put(path, bytes(data))
        elif op.endswith("/"):
            path.mkdir()
        elif ":" in rel:
            from safetensors.torch import load_file, save_file
            t, name = load_file(str(path)), rel.partition(":")[2]
            if value in ("nan", "inf", "f64", "cut"):
                t[name] = (t[name].double() if value == "f64" else t[name][:7].clone()
                           if value == "cut" else t[name].fill_(float(value)))
            elif value:
                t[name] = t[value] + 1  # an extra tensor
            else:
                t.pop(name)
            path.unlink()
            save_file(t, str(path))
        elif eq:
            put(path, path.read_bytes()[:1 << 20] if value == "@MIB" else CONTENT.get(value, value))
        if op.endswith("!"):  # record the new checksum (the shard's in its index too)
            m, digest = json.loads((d / manifest).read_text()), hashlib.sha256
            m["files"][path.name] = digest(path.read_bytes()).hexdigest()
            if path.name == "shard-00000.safetensors":
                index = d / "shard-00000.json"
                put(index, json.dumps({**json.loads(index.read_text()), "checksum": m["files"][
                    path.name]}))
                m["files"][index.name] = digest(index.read_bytes()).hexdigest()
            put(d / manifest, json.dumps(m))


def link_tree(src: Path, dst: Path) -> None:  # big files hard-linked: attacks replace them
    shutil.copytree(src, dst, copy_function=lambda a, b: os.link(a, b) if os.path.getsize(a)
                    > 1 << 20 else shutil.copy2(a, b))


POSITIVE = ("model.num_layers model.hidden_size model.num_heads model.num_kv_heads "
            "model.ffn_hidden_size model.vocab_multiple model.max_seq_len model.vocab_size "
            "parallel.tp parallel.pp parallel.cp parallel.ep parallel.vpp train.steps "
            "train.global_batch train.micro_batch train.seq_len train.eval_batches "
            "train.log_every data.vocab_size checkpoint.keep_last precision.fp8_block "
            "precision.fp8_history")
VALUES = {  # key: bad values (wrong types, out of range, non-finite, unknown choices)
    "model.num_layers": "abc|2.5|[1, 2]|{a: 1}|true", "train.steps": "abc|2.5|[1]|true",
    "train.global_batch": "x|1.5", "train.lr": "abc|[0.1]|0|-1|nan|inf|-inf",
    "train.eps": "{x: 1}|0|-1e-8|nan|inf", "run.dir": "[a, b]", "train.min_lr": "-1|nan|0.5",
    "train.warmup_steps": "-1", "train.weight_decay": "-0.1|nan|inf",
    "train.beta1": "1.5|-0.1|1.0|nan", "train.beta2": "1.5|-0.1|nan",
    "train.grad_clip": "-1|nan|inf", "train.eval_every": "-1", "model.init_std": "-0.02|nan|inf",
    "model.dropout": "1.0|-0.1|nan", "model.rope_theta": "0|-1|nan|inf",
    "model.norm_eps": "0|-1|nan", "data.valid_fraction": "0|1|-0.5|nan",
    "data.corpus_max_mb": "0|-1|nan", "run.timeout_s": "0|-1|nan",
    "parallel.bucket_mb": "0|-1|nan|inf", "train.peak_flops": "0|-1|nan",
    "checkpoint.every": "-1", "parallel.zero": "4|-1", "precision.dtype": "fp12",
    "precision.reduce_dtype": "fp16", "precision.fp8": "yes", "precision.fp8_grad": "e3m4",
    "precision.fp8_amax": "min", "parallel.schedule": "zz", "parallel.cp_comm": "tcp",
    "train.recompute": "most", "model.arch": "bert", "model.preset": "huge",
    "checkpoint.on_corrupt": "ignore", "parallel.sp": "maybe", "run.progress": "2",
    "checkpoint.resume": "perhaps", "model.tie_embeddings": "0.5"}
MOE = ("score=relu aux_loss_scope=batch compute=x top_k=9 groups=3 dense_layers=4 "
       "pad_to_capacity=true num_experts=-1 aux_loss=-1 route_scale=nan capacity_factor=-1 "
       "topk_groups=2")
LAYOUTS = (  # inconsistent, impossible with --nproc 1, or asking for terabytes
    "--parallel.tp=2; --parallel.pp=2; --parallel.cp=2; --parallel.ep=2; --parallel.tp=3; "
    "--parallel.vpp=2; --parallel.schedule=interleaved; --parallel.etp=2; "
    "--parallel.pp_layers=1,1; --parallel.pp_layers=5; --model.num_heads=7; "
    "--model.num_kv_heads=3; --data.reset_positions=true; "
    "--precision.dtype=fp64 --precision.fp8=tensorwise; "
    "--precision.dtype=fp64 --precision.reduce_dtype=bf16; --train.micro_batch=3; "
    "--train.seq_len=4096; --train.seq_len=2000000000; --checkpoint.resume_from=abc; "
    "--checkpoint.resume_from=7; --checkpoint.resume=false --checkpoint.resume_from=1; "
    "--model.hidden_size=1099511627776; --model.vocab_size=100000000000; "
    "--model.num_layers=1000000000; --model.ffn_hidden_size=1000000000000; "
    "--model.max_seq_len=1000000000000; --train.global_batch=1000000000; "
    f"--model.vocab_size=100; --data.vocab_size=10; --model.hidden_size=1{'0' * 30}")
ARGS = ("--model.hiden_size=256; --trian.steps=2; --model.moe.topk=2; --parallel.tp.x=1; "
        "--model=1; --model.=3; --.steps=1; steps=2; --steps=2; -x; --model.moe=3; "
        "--run.dir.x=1; --Train.steps=2; --train.steps=2=3; --train.steps")
PATHS = (
    "--data.path=/nonexistent/x.txt; --data.path=; --data.path=W/b.txt +b.txt=@G; "
    "--data.path=W/e.txt +e.txt=@E; --data.path=W/d +d/; --data.path=W/g.jsonl +g.jsonl={oops; "
    "--data.path=W/n.jsonl '+n.jsonl={\"x\":1}\\n'; --data.path=W/n.jsonl '+n.jsonl={\"text\":5}'"
    "; --data.path=W/t.txt +t.txt=hi; --data.path=-1:W/a.txt +a.txt=@T; "
    "--data.path=0:W/a.txt +a.txt=@T; --data.path=W/p +p.bin=@G +p.idx=@G; "
    "--data.tokenizer=/nonexistent/tok.json; --data.tokenizer=W/t.json +t.json=@G; "
    "--data.tokenizer=W/t.json +t.json=[1]; --run.dir=W/f +f=x; --checkpoint.dir=W/f +f=x; "
    "--data.cache_dir=W/f +f=x; --run.dir=/proc/meshtron-run; --checkpoint.dir=/proc/m-ckpt; "
    "+run/config.yaml=@G; +run/config.yaml=[1,2]; '+run/config.yaml=model:\\n  hidden_size: 128'"
    "; +run/checkpoints/step_00000005=x; --config /nonexistent.yaml; --config W/d +d/; "
    "--nproc 0; --nproc -1; --nproc abc; --nproc 2 --parallel.tp=3; --nproc 3 --parallel.pp=2")
YAMLS: dict[str, bytes | str] = {
    "binary": GARBAGE, "dup-section": "model:\n  num_layers: 2\nmodel:\n  num_heads: 4\n",
    "dup-key": "train:\n  lr: 0.001\n  lr: 0.002\n", "top-list": "- model\n- train\n",
    "top-scalar": "42\n", "top-string": "just text\n", "section-list": "model: [1, 2]\n",
    "section-scalar": "train: 5\n", "value-mapping": "train:\n  lr: {a: 1}\n",
    "value-list": "model:\n  num_layers: [1, 2]\n", "huge-float": "train:\n  lr: 1.0e+400\n",
    "huge-int": "model:\n  num_layers: 100000000000000000000000000000\n",
    "unicode-section": "mödel:\n  num_layers: 2\n", "unicode-value": "model:\n  arch: llamä\n",
    "emoji-key": "train:\n  🚀: 1\n", "bom-bad-value": "\ufefftrain:\n  lr: -1\n",
    "tabs": "train:\n\tlr: 0.1\n", "unclosed": "train: {lr: 0.1\n",
    "python-tag": "train: !!python/object/apply:os.system ['touch PWNED']\n",
    "alias-bomb": "model:\n  arch: [" + ", ".join(  # 9**9 references, one repr away
        f"&{c} [{', '.join([('*' + p) if p else 'x'] * 9)}]"
        for p, c in zip(" abcdefgh", "abcdefghi")) + "]\n",
    "null-key": "null: 1\n", "int-key": "1: 2\n", "unknown-key": "train:\n  learning_rate: 1\n",
    "deep-nesting": "model: " + "[" * 20000 + "]" * 20000 + "\n",
    "unknown-section": "optimizer:\n  lr: 0.1\n", "nan-lr": "train:\n  lr: .nan\n",
    "inf-eps": "train:\n  eps: .inf\n", "bool-as-int": "model:\n  num_layers: true\n",
    "latin1": "train:\n  lr: 0.1 # caf\xe9\n".encode("latin-1"),
    "utf16": "train:\n  lr: -1\n".encode("utf-16"), "nul-byte": b"train:\n  lr: 0.1\x00\n",
    "two-documents": "train:\n  lr: 1\n---\na: 1\n",
    "moe-mapping": "model:\n  moe:\n    top_k:\n      x: 1\n", "!empty": "", "!comment": "# x\n"}
GENERATE = (
    "--max-new-tokens -5; --max-new-tokens abc; --temperature nan; --temperature inf; "
    "--temperature -1; --temperature -inf; --top-k -3; --top-p 2; --top-p 0; --top-p -0.5; "
    f"--top-p nan; --top-p inf; --seed {2**70}; --checkpoint /nonexistent; --checkpoint W/b "
    "+b=@G; --checkpoint W/d +d/; --checkpoint W/r +r/config.yaml=@G; --checkpoint W/r "
    "'+r/config.yaml=model: {}'; --bogus; junk")
SCHEDULE = (
    "--pp 0; --pp -1; --pp 100000; --vpp 0; --vpp -2; --microbatches 0; --microbatches -1; "
    "--microbatches 100000; --pp 100000 --microbatches 100000; --schedule foo; --schedule '';"
    " --schedule interleaved; --pp abc; --out /proc/x.png; --out W/f/x.png +f=x; --bogus")
PLOT = (
    "W/nope; W/f +f=x; W/r +r/; W/r +r/metrics.jsonl=@E; W/r +r/metrics.jsonl=@G; "
    "W/r '+r/metrics.jsonl=oops\\n{bad'; W/r '+r/metrics.jsonl=[1,2]\\n'; "
    "W/r '+r/metrics.jsonl={\"step\":1}'; W/r '+r/metrics.jsonl={\"step\":1,\"loss\":\"x\"}'; "
    "W/r '+r/metrics.jsonl={\"loss\":1.0}'; W/r +r/metrics.jsonl/; "
    "W/r --output /proc/x.png +r/metrics.jsonl=@R; W/r --output W/f/x.png +r/metrics.jsonl=@R "
    "+f=x; W/r W/nope +r/metrics.jsonl=@R; W/r --bogus +r/metrics.jsonl=@R; "
    "!W/r +r/metrics.jsonl=@RT")
PREPROCESS = (
    "W/nope.txt; W/e.txt +e.txt=@E; W/b.txt +b.txt=@G; W/d +d/; W/d +d/b.txt=@G; "
    "W/g.jsonl +g.jsonl={oops; W/n.jsonl '+n.jsonl={\"x\":1}'; W/n.jsonl '+n.jsonl={\"text\":5}'"
    "; W/a.txt --tokenizer /nonexistent.json +a.txt=@T; W/a.txt --tokenizer W/t.json "
    "+a.txt=@T +t.json=@G; W/a.txt --vocab-size 0 +a.txt=@T; W/a.txt --vocab-size -1 +a.txt=@T"
    "; W/a.txt --vocab-size 10 +a.txt=@T; W/a.txt --vocab-size abc +a.txt=@T; W/a.txt "
    "--output W/f/p +a.txt=@T +f=x; W/a.txt --output /proc/p +a.txt=@T; W/a.txt --output '' "
    "+a.txt=@T; W/a.txt --cache-dir W/f +a.txt=@T +f=x")
CONVERT = (
    "--from /nonexistent --to W/o; --from W/f --to W/o +f=x; --from W/d --to W/o +d/; "
    "--from W/d --to W/o +d/x.txt=@G; --from S/base --to W/o --format xyz; "
    "--from S/base --to W/o; --from S/base --to W/o --format hf +o/x=x; "
    "--from S/base --to W/o --format hf +o=x; --from S/base --to /proc/o --format hf; "
    "--from S/base --to W/o --bogus")
HF = (  # attacks on a copy of S/hf (see apply): pointers edit its config.json
    '/model_type="bert"; /architectures=["BertModel"]; /hidden_size=16777216; /vocab_size=-1; '
    '/vocab_size=1099511627776; /num_hidden_layers=0; /num_hidden_layers="four"; /rope_theta=NaN;'
    " /num_attention_heads=7; /hidden_size; config.json=@G; config.json=[1,2]; config.json=@E; "
    "config.json=@DEEP; -model.safetensors; model.safetensors=@G; model.safetensors=@MIB; "
    "-model.safetensors pytorch_model.bin=@P; model.safetensors:model.embed_tokens.weight=nan; "
    "model.safetensors:model.norm.weight=inf; model.safetensors:model.norm.weight=cut; "
    "model.safetensors:lm_head.weight=; model.safetensors:model.bogus=model.norm.weight")


def escaping_index(hf: Path) -> None:  # the weights moved to ../x.safetensors, an index there
    head = (hf / "model.safetensors").read_bytes()
    names = json.loads(head[8:8 + int.from_bytes(head[:8], "little")])
    put(hf / "model.safetensors.index.json", json.dumps({"weight_map": {
        n: "../x.safetensors" for n in names if n != "__metadata__"}}))
    os.replace(hf / "model.safetensors", hf.parent / "x.safetensors")


def bad_inputs() -> list[Case]:
    values = [f"--{k}={v}" for k in POSITIVE.split() for v in ("0", "-2")] + [
        f"--{k}={v}" for k, vs in VALUES.items() for v in vs.split("|")]
    cases = [Case("train", a, [*TRAIN, a]) for a in values + ARGS.split("; ")]
    cases += [Case("train", f"tiny-moe moe.{kv}", [*TRAIN, "--model.preset=tiny-moe",
                                                   f"--model.moe.{kv}"]) for kv in MOE.split()]
    cases += [Case("train-yaml", n, [*TRAIN, "--config", "W/c.yaml"], files({"c.yaml": text}),
                   "ok" if n.startswith("!") else "error") for n, text in YAMLS.items()]
    cases += entries(LAYOUTS, "train-layout", TRAIN) + entries(PATHS, "train-paths", TRAIN)
    cases += entries(GENERATE, "generate", ["generate", "--checkpoint", "S/base", "--prompt",
                                            "hi", "--max-new-tokens", "2"])
    cases += entries(SCHEDULE, "schedule", ["schedule"]) + entries(PLOT, "plot", ["plot"])
    cases += entries(PREPROCESS, "preprocess", ["preprocess", "--cache-dir", "S/cache",
                                                "--output", "W/out/p"])
    cases += entries(CONVERT, "convert", ["convert"])
    edits = [*((e, lambda hf, e=e: apply(hf, e, "config.json")) for e in HF.split("; ")),
             ("index names ../x.safetensors", escaping_index)]
    return cases + [Case("convert-hf", name, ["convert", "--from", "W/hf", "--to", "W/o"],
                         lambda w, f=f: (link_tree(w.parent.parent / "shared" / "hf", w / "hf"),
                                         f(w / "hf"))) for name, f in edits]


ATTACKS = {  # expected for resume/generate/convert: attacks on the newest checkpoint (apply)
    "EEE": '-meta.json; meta.json=@G; meta.json=[1,2,3]; meta.json=@E; meta.json=@DEEP; '
           "~shard-00000.safetensors; shard-00000.safetensors=@MIB; -shard-00000.safetensors; "
           "shard-00000.safetensors=@G!; pytorch_model.bin=@P!; model.pt=@P!; "
           "shard-00000.safetensors:p0=nan!; shard-00000.safetensors:p1=inf!; "
           "shard-00000.safetensors:p0=f64!; shard-00000.safetensors:p0=cut!; "
           "shard-00000.safetensors:p3=!; -../../checkpoints ../../checkpoints=x; "
           "../step_99999999=x; ../step_99999999/; meta.json=@G ../step_00000001/meta.json=@G; "
           '/format=99; /format="2"; /format; /files/~1etc~1passwd="0"; /files/..~1x="0"; '
           '/files=["shard-00000.safetensors"]; /files={}; /files/shard-00000.safetensors=123; '
           "/tensors/model~1embed.weight/shape=[1000000000000,1000000]; "
           '/tensors/model~1embed.weight/shape=[-1,256]; /tensors/model~1embed.weight/dtype='
           '"complex128"; /tensors/model~1embed.weight/dtype="object"; '
           "/tensors/model~1embed.weight/pieces/0/offset=[8000,0]; "
           "/tensors/model~1embed.weight/pieces/0/size=[4096,256]; "
           '/tensors/model~1embed.weight/pieces/0/file="shard-00001.safetensors"; '
           '/tensors/model~1embed.weight/pieces/0/key="p999"; /tensors=[1]; '
           "/tensors/model~1final_norm.weight; /config; /config=\"x\"; "
           "/config/model/hidden_size=16777216; /config/model/num_layers=1000000; "
           "/config/model/vocab_size=1000000000000; /config/model/hidden_size=128; "
           '/config/model/num_heads=7; /config/model/preset="gigantic"; /config/model/bogus=1; '
           '/config/model=[1]; /step=-5; /step="six"; /step=2.5; /step=NaN; /step',
    "EAA": "/tensors/optim~1final_norm.weight~1exp_avg; /step=1000000000; /step=1; "
           '/world_size=0; /rng/0/key="nope"; /rng/0/key="p0"; /rng/0/file="../x"; /rng="x"; '
           '/optimizer/steps="x"; /data/next_batch=-1; ../../config.yaml=@G; '
           "../../config.yaml=[1]",
    "AEE": "-tokenizer.json; tokenizer.json=@G; tokenizer.json=@G!",
    "AAA": "shard-00000.json=@G; ../latest=@G; ../latest=../../../../etc",
    "KKK": "control; ~../step_00000001/shard-00000.safetensors; "
           "../.tmp-step_00000003-deadbeef0000/shard-00000.json={"}


NEWEST = [(e, x) for x, es in ATTACKS.items() for e in es.split("; ")]
COMMANDS = {"resume": [*TRAIN, "--train.steps=3"],
            "generate": ["generate", "--checkpoint", "W/run", "--prompt", "hi",
                         "--max-new-tokens", "2"],
            "convert": ["convert", "--from", "W/run", "--to", "W/hf", "--format", "hf"]}


def checkpoint_cases() -> list[Case]:
    def attack(entry: str) -> Setup:  # on a copy of the real run's newest checkpoint
        return lambda w: (link_tree(w.parent.parent / "shared" / "base", w / "run"),
                          apply(w / "run" / "checkpoints" / "step_00000002", entry, "meta.json"))
    return [Case(f"ckpt-{cmd}", e, argv, attack(e), EXPECT[expect[i]])
            for i, (cmd, argv) in enumerate(COMMANDS.items()) for e, expect in NEWEST] + [
        Case("ckpt-resume", "meta.json=@G with checkpoint.on_corrupt=previous", [
            *COMMANDS["resume"], "--checkpoint.on_corrupt=previous"], attack("meta.json=@G"), "ok")]



def classify(case: Case, rc: int, out: str, err: str, pwned: bool) -> tuple[str, str]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("meshtron: error:")]
    other = [ln for ln in lines if not ln.startswith(("meshtron: error:", "warning:"))]
    if pwned:
        return "pickle-ran", "a pickle payload ran"
    if "Traceback" in out or "Traceback" in err:
        text = (err if "Traceback" in err else out).splitlines()
        frames = [ln.strip() for ln in text if ln.strip().startswith('File "')] or ["?"]
        raised = [ln for ln in text if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b", ln)]
        return "traceback", f"{(raised or text or [''])[-1][:300]}  [last frame: {frames[-1]}]"
    if rc == 0:
        if case.expect != "error":
            return "ok", ""
        return "wrong-success", "exit 0; stdout ends: " + " | ".join(out.strip().splitlines()[-2:])
    if case.expect == "ok":
        return "refused-valid", (errors or lines or [f"exit {rc}"])[-1]
    if rc < 0:
        return "crashed", f"killed by signal {-rc}"
    if lines and lines[0].startswith("usage:") and re.match(r"meshtron \w+: error:", lines[-1]):
        return "usage", lines[-1]
    if len(errors) == 1 and not other:
        return "refused", errors[0]
    return "bad-stderr", (f"exit {rc}, {len(errors)} error line(s), {len(other)} other line(s): "
                          + " | ".join((other[:2] + errors[:1]) or ["(stderr empty)"]))


def run_case(index: int, case: Case, tmp: Path, env: dict[str, str], timeout: float) -> dict:
    w, shared = tmp / "cases" / f"{index:04d}", tmp / "shared"
    w.mkdir(parents=True)
    command = "meshtron " + shlex.join(case.argv).replace(shlex.join(TRAIN[1:]), "<TRAIN FLAGS>")
    r: dict[str, Any] = {"index": index, "category": case.category, "name": case.name, "rc": None,
                         "command": command, "expect": case.expect, "seconds": 0, "warnings": 0}
    try:
        if case.setup:
            case.setup(w)
    except Exception as err:  # a harness bug, reported as one
        shutil.rmtree(w, ignore_errors=True)
        return {**r, "outcome": "setup-error", "detail": f"{type(err).__name__}: {err}"[:300],
                "stderr_tail": []}
    start, cap = time.monotonic(), 8 << 30
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtron", *(sub(a, w, shared) for a in case.argv)], cwd=w,
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS,
                                                                      (cap, cap)))
    try:
        (out_b, err_b), hung = proc.communicate(timeout=timeout), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        (out_b, err_b), hung = proc.communicate(), True
    with contextlib.suppress(ProcessLookupError, PermissionError):  # what it left running
        os.killpg(proc.pid, signal.SIGKILL)
    out, err = (b.decode(errors="replace").replace(str(w), "W").replace(str(shared), "S")
                for b in (out_b, err_b))
    outcome, detail = ("hang", f"no exit within {timeout:.0f} s (killed)") if hung else classify(
        case, proc.returncode, out, err, (w / "PWNED").exists())
    shutil.rmtree(w, ignore_errors=True)
    return {**r, "rc": proc.returncode, "seconds": round(time.monotonic() - start, 2),
            "outcome": outcome, "detail": detail[:400],
            "warnings": sum(ln.startswith("warning:") for ln in err.splitlines()),
            "stderr_tail": [ln[:300] for ln in err.strip().splitlines()[-4:]]}


def prepare_shared(shared: Path, env: dict[str, str], timeout: float) -> None:
    """One real tiny run (checkpoints at steps 1 and 2) and its Hugging Face export."""
    for argv in ([sub(a.replace("W/run", "S/base"), shared, shared) for a in TRAIN],
                 ["convert", "--from", f"{shared}/base", "--to", f"{shared}/hf", "--format", "hf"]):
        proc = subprocess.run([sys.executable, "-m", "meshtron", *argv], cwd=shared, env=env,
                              capture_output=True, text=True, timeout=timeout * 3)
        if proc.returncode != 0:
            sys.exit(f"adversarial: preparing failed: {shlex.join(argv)}\n{proc.stderr[-2000:]}")


def report(results: list[dict], list_failures: bool) -> int:
    cols = {"refused": ("refused",), "ok": ("ok",), "usage": ("usage",), "hang": ("hang",),
            "traceback": ("traceback",), "wrong-ok": ("wrong-success",), "stderr": ("bad-stderr",),
            "other": FAILURES[4:]}
    print(f"{'category':<14}{'cases':>6}" + "".join(f"{c:>10}" for c in cols) + f"{'warn':>6}")
    cats = sorted({r["category"] for r in results}, key=lambda c: (c.startswith("ckpt"), c))
    for cat in [*cats, "TOTAL"]:
        rs = [r for r in results if cat in ("TOTAL", r["category"])]
        n = [sum(r["outcome"] in outcomes for r in rs) for outcomes in cols.values()]
        print(f"{cat:<14}{len(rs):>6}" + "".join(f"{v:>10}" for v in n)
              + f"{sum(r['warnings'] for r in rs):>6}")
    failed = [r for r in results if r["outcome"] in FAILURES]
    ckpt = [r for r in results if r["category"].startswith("ckpt")]
    print(f"total: {len(results)} cases ({len(results) - len(ckpt)} bad inputs, {len(ckpt)} "
          f"checkpoint cases from {len(NEWEST)} attacks), {len(failed)} failing "
          f"({sum(r in ckpt for r in failed)} of them checkpoint cases)")
    if list_failures and failed:
        print(f"\n<TRAIN FLAGS> = {shlex.join(TRAIN[1:])}")
        for r in failed:
            print(f"\n[{r['outcome']}] {r['category']} / {r['name']} (exit {r['rc']}, "
                  f"{r['seconds']} s)\n  $ {r['command']}\n  {r['detail']}")
            print("".join(f"    | {line}\n" for line in r["stderr_tail"]), end="")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 cases spread over each category")
    parser.add_argument("--only", help="run the cases whose 'category/name' matches this regex")
    parser.add_argument("--list-failures", action="store_true")
    parser.add_argument("--json", help="write every result to this file")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a hang")
    args = parser.parse_args()
    cases = bad_inputs() + checkpoint_cases()
    if args.only:
        cases = [c for c in cases if re.search(args.only, f"{c.category}/{c.name}")]
    if args.quick:
        per = {c.category: [d for d in cases if d.category == c.category] for c in cases}
        cases = [c for c in cases if per[c.category].index(c) % -(-len(per[c.category]) // 3) == 0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshtron-adversarial-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "shared" / "home").mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
               "HOME": str(tmp / "shared" / "home"), "OMP_NUM_THREADS": "1"}
        env.pop("MESHTRON_TRACEBACK", None)
        if any(c.category not in ("schedule", "plot", "preprocess") for c in cases):
            prepare_shared(tmp / "shared", env, args.timeout)
        results = []
        with ThreadPoolExecutor(args.workers) as pool:
            futures = [pool.submit(run_case, i, c, tmp, env, args.timeout)
                       for i, c in enumerate(cases)]
            for done, future in enumerate(as_completed(futures), 1):
                results.append(r := future.result())
                if r["outcome"] in FAILURES or done % 50 == 0:
                    print(f"[{done}/{len(cases)}] {r['outcome']:<13} {r['category']}/{r['name']}",
                          file=sys.stderr, flush=True)
    results.sort(key=lambda r: r["index"])
    code, wall = report(results, args.list_failures), time.monotonic() - started
    print(f"wall time: {wall:.0f} s ({args.workers} workers, timeout {args.timeout:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"wall_s": round(wall), "results": results}))
    return code


if __name__ == "__main__":
    sys.exit(main())
