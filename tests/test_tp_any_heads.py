"""Tensor parallelism for head counts that are not powers of two (issue 45): tp only has to
divide the padded vocabulary (one size under every layout), not ``model.vocab_multiple``, so a
9-head model with 3 kv heads and 49,152 tokens (SmolLM2-135M) runs at tp=3; kv heads fewer than
tp ranks are shared (replicated) by groups of ranks. Parity at tp=3 against one process, in
fp64 to 1e-9, for 9 heads / 3 kv heads (with and without sequence parallelism) and 6 heads /
1 kv head (multi-query attention shared by all three ranks, with Qwen's q/k norms and biases).
"""

from __future__ import annotations

import pytest

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.costmodel.problem import Problem
from meshtron.costmodel.profiles import load_profile
from meshtron.costmodel.search import Pins, candidates
from meshtron.errors import MeshtronError
from meshtron.plan import check_run, plan_generation, plan_run
from tests.distributed import run_distributed
from tests.parity import FP64_RTOL, FP64_STEPS, assert_layouts_match, run_layouts

SMOLLM2 = ["--model.num_layers=30", "--model.hidden_size=576", "--model.num_heads=9",
           "--model.num_kv_heads=3", "--model.ffn_hidden_size=1536", "--model.max_seq_len=2048",
           "--model.tie_embeddings=true", "--train.seq_len=256", "--train.global_batch=3"]
"""SmolLM2-135M's shape (9 heads, 3 kv heads, the vocabulary set per test)."""


def smollm2(*extra: str):
    return load_config(overrides=[*SMOLLM2, *extra])


def test_tp3_is_planned_for_a_vocabulary_that_splits_over_3():
    cfg = smollm2("--model.vocab_size=49152", "--parallel.tp=3")
    check_run(cfg, 3)
    assert plan_run(cfg, 3).padded_vocab == 49152  # 128 x 384 = 3 x 16,384
    assert plan_generation(smollm2("--model.vocab_size=49152", "--parallel.tp=3"), 3).layout.tp == 3
    # the tokenizer's vocabulary decides when the config leaves it unset
    assert plan_run(smollm2("--parallel.tp=3"), 3, tokenizer_vocab=49152).padded_vocab == 49152


def test_a_padded_vocabulary_that_does_not_split_is_refused_in_one_line():
    cfg = smollm2("--model.vocab_size=49153", "--parallel.tp=3")  # padded 49,280 = 385 x 128
    with pytest.raises(MeshtronError) as err:
        check_run(cfg, 3)
    message = str(err.value)
    assert "parallel.tp=3 does not divide the padded vocabulary of 49280" in message
    assert "model.num_heads=9: 1;" in message and "\n" not in message
    # unknown before the tokenizer exists: not refused then, refused by the trainer's plan
    check_run(smollm2("--parallel.tp=3"), 3)
    with pytest.raises(MeshtronError, match="padded vocabulary of 49280"):
        plan_run(smollm2("--parallel.tp=3"), 3, tokenizer_vocab=49153)


def test_meshtron_train_refuses_it_before_any_process_starts(tmp_path, capsys):
    args = ["train", *SMOLLM2, "--model.vocab_size=49153", "--parallel.tp=3", "--nproc", "3",
            f"--run.dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "does not divide the padded vocabulary of 49280" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_tuner_considers_tp3_where_the_padded_vocabulary_splits():
    profile = load_profile("h100-sxm")
    for vocab, splits in ((49152, True), (49153, False)):
        model = smollm2(f"--model.vocab_size={vocab}").model
        problem = Problem(model, 256, 3, profile, 3)
        assert any(c.tp == 3 for c in candidates(problem, Pins(tp=3))) == splits, vocab


MODEL = ["--model.hidden_size=72", "--model.ffn_hidden_size=96", "--model.vocab_multiple=96",
         "--train.seq_len=48", "--precision.dtype=fp64", f"--train.steps={FP64_STEPS}"]
"""72 wide (head_dim 8 with 9 heads, 12 with 6), 96 FFN units and a 576-row padded vocabulary
(the tokenizer's 512 rounded up to 96: 128 would not split over 3), 48 positions (sp over 3)."""
LAYOUTS = [
    [*MODEL, "--model.num_heads=9", "--model.num_kv_heads=3", "--parallel.tp=3"],
    [*MODEL, "--model.num_heads=9", "--model.num_kv_heads=3", "--parallel.tp=3",
     "--parallel.sp=true"],
    [*MODEL, "--model.num_heads=6", "--model.num_kv_heads=1", "--parallel.tp=3",
     "--parallel.sp=true", "--model.tie_embeddings=true", "--model.qk_norm=true",
     "--model.qkv_bias=true"],
]


@pytest.mark.slow
def test_tp3_with_9_heads_and_shared_kv_heads_keeps_fp64_parity(data_cache, tmp_path):
    results = run_distributed(run_layouts, 3, data_cache, str(tmp_path), LAYOUTS)
    assert_layouts_match(LAYOUTS, results, data_cache, tmp_path, lambda layout: FP64_RTOL)
