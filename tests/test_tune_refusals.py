"""``meshtron tune`` when no layout passes: one line naming the check that removed the layouts,
with its numbers; and the Llama 3.1 presets at their published 128K context and rotary
scaling (as their config.json files say, through the HF import too)."""

from __future__ import annotations

import pytest
import torch

from meshtron.checkpoint.hf_config import hf_model_config
from meshtron.config import load_config
from meshtron.models.rotary import inverse_frequencies
from tests.test_tune_command import assert_one_line_error

TINY_8 = ["--model.preset=tiny", "--model.vocab_size=512", "--cluster.gpu=a100-80gb",
          "--cluster.gpus=8", "--precision.dtype=bf16", "--train.seq_len=256"]

# meta-llama/Llama-3.1-405B's config.json (the fields a model config reads)
LLAMA31_405B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
    "num_key_value_heads": 8, "num_hidden_layers": 126, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
SHAPE_FIELDS = ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                "ffn_hidden_size", "vocab_size", "max_seq_len", "rope_theta", "rope",
                "tie_embeddings")


def test_positions_beyond_the_preset_name_both_numbers_and_the_long_presets(capsys):
    line = assert_one_line_error(
        capsys, ["--model.preset=llama3-405b", "--train.seq_len=131072",
                 "--cluster.gpu=h100-sxm", "--cluster.gpus=16384"],
        "model.max_seq_len 8,192 < train.seq_len 131,072", "every layout refused",
        "--model.max_seq_len", "long-context preset")
    assert "llama3.1-405b" in line and "llama3-405b," not in line


def test_a_global_batch_no_data_parallel_size_divides_is_named(capsys):
    assert_one_line_error(capsys, [*TINY_8, "--parallel.tp=2", "--parallel.cp=1",
                                   "--parallel.pp=1", "--train.global_batch=6"],
                          "train.global_batch 6 is not a multiple", "(dp in [4])",
                          "multiple of 4")


def test_a_tp_that_divides_no_head_count_is_named(capsys):
    assert_one_line_error(capsys, [*TINY_8[:3], "--cluster.gpus=6", *TINY_8[4:],
                                   "--parallel.tp=3", "--train.global_batch=12"],
                          "no tp in [3] divides model.num_heads 8")


def test_sequence_parallelism_pinned_without_tp_is_named(capsys):
    assert_one_line_error(capsys, [*TINY_8, "--parallel.tp=1", "--parallel.sp=true",
                                   "--train.global_batch=16"],
                          "parallel.sp=true needs tp > 1")


def test_a_plan_check_refusing_every_fitting_layout_is_named(capsys):
    # tp_comm_overlap never combines with zb-h1's split backward: every layout fits and is
    # refused by the trainer's own plan, whose sentence the answer carries
    assert_one_line_error(capsys, [*TINY_8, "--parallel.schedule=zb-h1", "--parallel.sp=true",
                                   "--parallel.tp_comm_overlap=true", "--train.global_batch=16"],
                          "the trainer's plan refused every layout that fits",
                          "tp_comm_overlap does not combine with parallel.schedule=zb-h1")


def test_llama31_presets_carry_the_published_context_and_rope_scaling():
    imported = hf_model_config(LLAMA31_405B)
    for size in ("8b", "70b", "405b"):
        m = load_config(overrides=[f"--model.preset=llama3.1-{size}"]).model
        base = load_config(overrides=[f"--model.preset=llama3-{size}"]).model
        assert (m.max_seq_len, base.max_seq_len) == (131072, 8192)
        r = m.rope
        assert (r.scaling, r.factor, r.original_max_len, r.low_freq_factor,
                r.high_freq_factor) == ("llama3", 8.0, 8192, 1.0, 4.0)
        assert base.rope.scaling == "none"
        assert all(getattr(m, k) == getattr(base, k) for k in SHAPE_FIELDS
                   if k not in ("max_seq_len", "rope"))
    ours = load_config(overrides=["--model.preset=llama3.1-405b"]).model
    assert {k: getattr(ours, k) for k in SHAPE_FIELDS} == \
        {k: getattr(imported, k) for k in SHAPE_FIELDS}
    # a field given on the command line wins over the preset's scaling
    tuned = load_config(overrides=["--model.preset=llama3.1-8b", "--model.rope.factor=4"])
    assert tuned.model.rope.factor == 4.0 and tuned.model.rope.scaling == "llama3"


@pytest.mark.slow  # transformers' import: 5-6 s here
def test_llama31_rotary_tables_equal_transformers_for_the_published_config():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = load_config(overrides=["--model.preset=llama3.1-8b"]).model
    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **LLAMA31_405B["rope_scaling"]})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours, factor = inverse_frequencies(m.hidden_size // m.num_heads, m.rope_theta, m.rope,
                                       m.max_seq_len)
    assert factor == 1.0 and torch.equal(ours, theirs.float())
    plain, _ = inverse_frequencies(128, 500000.0, load_config(
        overrides=["--model.preset=llama3-8b"]).model.rope, 8192)
    assert not torch.equal(plain, ours)  # the scaling is really applied
