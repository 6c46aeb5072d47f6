"""Generation on tp x pp ranks gives the one-process greedy tokens (llama and MoE); a checkpoint
saved under one layout generates under another; batched prompts get the tokens they get alone;
bf16 runs and is a checkpoint's default when saved so; bad input is one line.

Every multi-process case runs in one group of 4 spawned ranks (start-up dominates on CPU): the
2-rank layouts run there as two replicas (dp = 2), each generating alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.loading import load_model, open_for_inference
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.cli import main
from meshtron.inference.generate_command import generation_config
from meshtron.models.generation import GREEDY, Generator
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.plan import plan_generation
from tests.distributed import run_distributed
from tests.parity import run_training, test_overrides

PROMPTS = ["def ", "import os\nclass A:", "x"]  # different lengths: left padding
NEW = 6
MOE = ["--model.moe.num_experts=4", "--model.moe.top_k=2", "--model.moe.expert_ffn_size=64"]
MODELS = {"llama": ["--model.num_kv_heads=2"], "moe": MOE}
HALVES = ("--parallel.pp_layers=1.5,0.5",)  # stage 1: layer 1's MLP half only, no attention
LAYOUTS = [(2, 1, ()), (1, 2, ()), (2, 2, ()), (1, 2, HALVES)]  # (tp, pp, settings)


def greedy(path: str | Path, tp: int = 1, pp: int = 1, rank: int = 0, world_size: int = 1,
           prompts: list[str] = PROMPTS, settings: tuple[str, ...] = (),
           eos_id: int | None = None, stop=None) -> list:
    """Greedy completions (tokens, finish) of ``prompts`` on this rank's part of tp x pp."""
    ckpt = open_for_inference(Path(path))
    cfg = generation_config(ckpt, [f"--parallel.tp={tp}", f"--parallel.pp={pp}", *settings])
    plan = plan_generation(cfg, tp * pp)
    mesh = ParallelMesh(MeshLayout(world_size, tp=tp, pp=pp), rank)
    model = load_model(ckpt, plan, mesh, cfg.precision.dtype)
    encoded = [ckpt.tokenizer.encode(p) for p in prompts]
    completions, _ = Generator(model, mesh).generate(encoded, NEW, GREEDY, eos_id, stop)
    return [(c.tokens, c.finish) for c in completions]


def group_cases(rank: int, world_size: int, cache: str, root: str,
                checkpoints: dict[str, str]) -> dict:
    """Worker body: save a checkpoint at tp=2 (x dp=2), then every layout of every model."""
    tp2 = f"{root}/tp2"
    run_training(test_overrides(cache, tp2, steps=2) + MODELS["llama"] + ["--parallel.tp=2"],
                 rank, world_size)
    torch.distributed.barrier()
    cases = [(name, *layout) for name in checkpoints for layout in LAYOUTS] + [("tp2", 2, 1, ())]
    paths = {**checkpoints, "tp2": tp2}
    return {(name, tp, pp, settings): greedy(paths[name], tp, pp, rank, world_size,
                                             settings=settings)
            for name, tp, pp, settings in cases}


@pytest.fixture(scope="module")
def checkpoints(data_cache, tmp_path_factory) -> dict[str, str]:
    """A llama and a MoE checkpoint, each trained 4 steps by one process."""
    root = tmp_path_factory.mktemp("generation")
    for name, extra in MODELS.items():
        run_training(test_overrides(data_cache, str(root / name), steps=4) + extra)
    return {name: str(root / name) for name in MODELS}


@pytest.fixture(scope="module")
def group(data_cache, checkpoints, tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("generation-group"))
    results = run_distributed(group_cases, 4, data_cache, root, checkpoints)
    for rank, result in enumerate(results[1:], start=1):
        assert result == results[0], f"rank {rank} generated other tokens than rank 0"
    return {**results[0], "tp2_path": f"{root}/tp2"}


@pytest.mark.parametrize("name", list(MODELS))
def test_tp_pp_generation_equals_one_process(group, checkpoints, name):
    reference = greedy(checkpoints[name])
    assert all(len(tokens) == NEW for tokens, _ in reference)  # nothing cut short
    for tp, pp, settings in LAYOUTS:
        assert group[(name, tp, pp, settings)] == reference, f"{name} at tp={tp} pp={pp} {settings}"


def test_checkpoint_saved_at_tp2_generates_at_tp1_and_back(group, checkpoints):
    assert greedy(group["tp2_path"]) == group[("tp2", 2, 1, ())]  # saved at tp=2, run at tp=1
    assert greedy(checkpoints["llama"]) == group[("llama", 2, 1, ())]  # at tp=1, run at tp=2


@pytest.mark.parametrize("name", list(MODELS))
def test_a_batch_generates_what_each_prompt_does_alone(checkpoints, name):
    batched = greedy(checkpoints[name])
    alone = [greedy(checkpoints[name], prompts=[prompt])[0] for prompt in PROMPTS]
    assert batched == alone


def test_eos_and_stop_rules_end_each_sequence_alone(checkpoints):
    reference = [tokens for tokens, _ in greedy(checkpoints["llama"])]
    eos, stop_token = reference[0][2], reference[1][3]

    def expected(tokens: list[int]) -> tuple[list[int], str]:
        for i, token in enumerate(tokens):
            if token == eos:
                return tokens[:i], "eos"
            if token == stop_token:
                return tokens[: i + 1], "stop"
        return tokens, "length"

    got = greedy(checkpoints["llama"], eos_id=eos, stop=lambda toks: toks[-1] == stop_token)
    assert got == [expected(tokens) for tokens in reference]
    assert got[0][1] == "eos" and got[1][1] == "stop"


def test_bf16_checkpoint_runs_in_bf16_unless_told(checkpoints, tmp_path, capsys):
    cfg, tensors = read_model_tensors(open_for_inference(Path(checkpoints["llama"])).path)
    ckpt_path = open_for_inference(Path(checkpoints["llama"])).path
    write_model_checkpoint(tmp_path / "bf16", cfg, {k: v.bfloat16() for k, v in tensors.items()},
                           tokenizer=ckpt_path / "tokenizer.json")
    ckpt = open_for_inference(tmp_path / "bf16")
    assert ckpt.saved_dtype == "bf16"
    for settings, dtype in (((), torch.bfloat16), (("--precision.dtype=fp32",), torch.float32)):
        cfg = generation_config(ckpt, list(settings))
        model = load_model(ckpt, plan_generation(cfg, 1), dtype=cfg.precision.dtype)
        assert model.blocks()[0].attn.q.weight.dtype == dtype
    completions = greedy(tmp_path / "bf16")
    assert all(len(tokens) == NEW for tokens, _ in completions)
    assert main(["generate", "--checkpoint", str(tmp_path / "bf16"), "--prompt", "def ",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_cli_batches_prompts_cuts_stop_strings_and_reports_speed(checkpoints, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("import os\nclass A:\n\nx\n")
    assert main(["generate", "--checkpoint", checkpoints["llama"], "--prompt", "def ",
                 "--prompt-file", str(tmp_path / "prompts.txt"), "--temperature", "0",
                 "--max-new-tokens", str(NEW), "--json"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["def ", "import os", "class A:", "x"]
    assert "generated" in err and "tokens/s" in err and "first token after" in err
    text = rows[3]["text"]
    stop = text[2:4] if len(text) >= 4 else text[-1:]
    assert main(["generate", "--checkpoint", checkpoints["llama"], "--prompt", "x", "--stop",
                 stop, "--temperature", "0", "--max-new-tokens", str(NEW), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["finish_reason"] == "stop" and row["text"] == text[: text.find(stop)]


@pytest.mark.parametrize("args,message", [
    (["--parallel.tp=3"], "parallel.tp=3 does not divide model.num_heads=4"),
    (["--nproc", "2", "--parallel.tp=4", "--parallel.pp=1"], "one model replica on"),
    (["--parallel.tp=2"], "on parallel.tp x parallel.pp = 2 x 1 = 2 ranks, not 1"),
    (["--nproc", "4", "--parallel.tp=2"], "= 2 ranks, not 4 (set --nproc to tp x pp)"),
    (["--parallel.ep=2"], "--parallel.ep: generation runs one model replica"),
    (["--model.hidden_size=32"], "not --model.hidden_size"),
    (["--precision.dtype=fp8"], "precision.dtype"),
    (["--prompt", "x " * 100], "tokens: the model has 64 positions"),
    (["--prompt-file", "/nonexistent/prompts.txt"], "--prompt-file not found"),
])
def test_bad_generation_input_is_one_line(checkpoints, capsys, args, message):
    assert main(["generate", "--checkpoint", checkpoints["llama"], *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_checkpoint_without_tokenizer_is_refused(checkpoints, tmp_path, capsys):
    cfg, tensors = read_model_tensors(open_for_inference(Path(checkpoints["llama"])).path)
    write_model_checkpoint(tmp_path / "bare", cfg, tensors)
    assert main(["generate", "--checkpoint", str(tmp_path / "bare"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no tokenizer.json" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_generate_nproc_2_prints_once_what_one_process_prints(checkpoints, tmp_path, capsys):
    args = ["generate", "--checkpoint", checkpoints["moe"], "--prompt", "def ", "--prompt",
            "import os", "--temperature", "0", "--max-new-tokens", str(NEW)]
    assert main(args) == 0
    one = capsys.readouterr().out
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    two = subprocess.run([sys.executable, "-m", "meshtron", *args, "--nproc", "2",
                          "--parallel.tp=2"], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=300)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one and one.count("---") == 1
    assert "on tp=2 x pp=1" in two.stderr and two.stderr.count("generated ") == 1
