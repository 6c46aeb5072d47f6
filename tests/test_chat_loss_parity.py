"""Loss on the answers only: targets that carry no loss add nothing and get no gradient, the
step's loss is the weighted mean over the global batch (its closed form, in one process), and
every layout reproduces the one-process run (fp64, 1e-9)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import load_config
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.tensor.loss import vocab_parallel_loss_sum
from meshtron.training.step import evaluate, train_step
from meshtron.training.trainer import Trainer
from tests.chat_data import chat_tokenizer, write_conversations
from tests.distributed import run_distributed
from tests.parity import FP64_RTOL, assert_same_numbers, run_each, run_training, test_overrides


def test_skipped_targets_add_nothing_and_get_no_gradient():
    torch.manual_seed(0)
    logits = torch.randn(12, 9, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (12,))
    targets[::3] = -1
    ours = vocab_parallel_loss_sum(logits, targets, ParallelMesh.single().tp, 0, 9)
    (grad,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert abs(float(ours.detach()) - float(ref.detach())) <= 1e-12 * abs(float(ref.detach()))
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-14) and not grad[::3].any()


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("chat-parity")
    tokenizer = chat_tokenizer(root / "tok", "chatml", vocab=512)
    return str(write_conversations(root / "chat.jsonl", 160)), str(tokenizer)


def chat_overrides(cache: str, run_dir: str, files: tuple[str, str]) -> list[str]:
    """The parity harness's tiny model on conversations, in fp64 for 8 steps."""
    data, tokenizer = files
    return test_overrides(cache, run_dir, steps=8) + [
        f"--data.path={data}", "--data.format=chat", f"--data.tokenizer={tokenizer}",
        "--train.seq_len=256", "--model.max_seq_len=256", "--precision.dtype=fp64",
        "--train.eval_every=8", "--train.eval_batches=2", "--data.valid_fraction=0.1"]


def test_the_step_loss_is_the_mean_over_answer_tokens(chat_files, data_cache, tmp_path):
    """Validation and the training step divide the answers' loss sum by their count: the
    closed form ``cross_entropy(ignore_index=-1)`` of the model's logits; counting every
    target instead gives a different number."""
    cfg = load_config(overrides=chat_overrides(data_cache, str(tmp_path / "run"), chat_files))
    trainer = Trainer(cfg, log=lambda m: None)
    batch = trainer.data.train_batch(0, cfg.train.global_batch)
    mb = trainer.split(batch)
    with torch.no_grad():
        logits = trainer.model(mb.tokens, sequence=mb.sequence).flatten(0, 1)
    logits = logits[:, :trainer.cfg.model.vocab_size]  # not the padding's columns
    targets = mb.targets.flatten()
    assert 0 < int((targets >= 0).sum()) < len(targets) // 2
    closed = float(F.cross_entropy(logits, targets, ignore_index=-1))
    every = float(F.cross_entropy(logits, torch.where(targets < 0, mb.tokens.flatten().roll(-1),
                                                      targets)))
    assert abs(evaluate(trainer.rank, [batch]) - closed) <= 1e-12 * closed
    assert abs(every - closed) > 1e-3 * closed
    out = train_step(trainer.rank, batch, lr=1e-3)
    assert abs(out.loss - closed) <= 1e-12 * closed
    assert out.loss_tokens == int((targets >= 0).sum())


LAYOUTS = [
    ["--parallel.tp=2", "--parallel.pp=2"],
    ["--parallel.cp=2", "--parallel.zero=1"],
    ["--parallel.zero=3", "--train.micro_batch=1"],
]


def _layouts(rank: int, world: int, cache: str, root: str, files: tuple[str, str]) -> list:
    return run_each([chat_overrides(cache, f"{root}/layout{i}", files) + layout
                     for i, layout in enumerate(LAYOUTS)], rank, world)


@pytest.mark.slow
def test_chat_loss_is_layout_independent(chat_files, data_cache, tmp_path):
    """tp x pp, cp x dp with ZeRO-1, dp=4 with ZeRO-3 and micro-batches of one: per-step loss,
    grad norm, the weighted validation loss and the final weights of the one-process run."""
    reference = run_training(chat_overrides(data_cache, str(tmp_path / "ref"), chat_files))
    results = run_distributed(_layouts, 4, data_cache, str(tmp_path), chat_files, timeout=900)
    for i, layout in enumerate(LAYOUTS):
        for rank, per_rank in enumerate(results):
            what = f"{' '.join(layout)} (rank {rank})"
            assert "error" not in per_rank[i], f"{what} raised:\n{per_rank[i]['error']}"
            assert_same_numbers(reference, per_rank[i], what, FP64_RTOL)


def test_a_chat_run_logs_its_answer_tokens_and_keeps_its_template(chat_files, data_cache,
                                                                  tmp_path):
    """metrics.jsonl counts the tokens each step's loss is averaged over (the answers, not
    the window), and every checkpoint carries the chat template beside its tokenizer, so a
    moved checkpoint still serves /v1/chat/completions."""
    import json

    from meshtron.checkpoint.loading import open_for_inference
    from meshtron.data.chat_template import find_chat_template

    overrides = chat_overrides(data_cache, str(tmp_path / "run"), chat_files)
    cfg = load_config(overrides=[*overrides, "--train.steps=2", "--train.eval_every=0"])
    result = Trainer(cfg, log=lambda m: None).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    tokens = [row["loss_tokens"] for row in rows if "loss" in row]
    window = cfg.train.global_batch * cfg.train.seq_len
    assert tokens and all(0 < t < window / 2 for t in tokens), tokens
    saved = find_chat_template(result.checkpoint / "tokenizer.json")
    assert saved.source == find_chat_template(Path(chat_files[1])).source
    opened = open_for_inference(result.checkpoint)  # what generate and serve read
    assert {"tokenizer_config.json", "tokenizer.json"} <= set(opened.manifest["files"])
