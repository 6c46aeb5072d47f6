"""A real released model end to end (SmolLM2-135M-Instruct, see tests/real_model.py): greedy
generation equal to transformers' ``generate`` for 64 tokens in one process, at tp=3 and at
pp=2; perplexity on held-out English far below chance; fine-tuning on English text under the
mesh (a step at tp=3, resumed for a second at pp=2 x dp=2 with ZeRO-3) equal to one process,
exported to Hugging Face and to GGUF, and transformers then generating exactly what ``meshtron
generate`` does.

The import itself (logits and tokenizer equal to transformers') is tests/test_gguf.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.loading import load_for_inference
from meshtron.cli import main
from meshtron.models.generation import GREEDY, Generator
from tests.real_model import english_text, transformers_from_gguf

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village,"]
NEW_TOKENS = 64
EOS = 2  # SmolLM2-Instruct's <|im_end|>, its generation config's eos_token_id
VOCAB = 49_152


@pytest.fixture(scope="module")
def smollm(smollm_checkpoint):
    """meshtron's model and tokenizer from the imported checkpoint (fp32)."""
    return load_for_inference(smollm_checkpoint)


@pytest.fixture(scope="module")
def transformers_greedy(smollm_transformers) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, 64 tokens (EOS not obeyed)."""
    model, tokenizer = smollm_transformers
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=2)
            out.append(tokens[0, ids.shape[1]:].tolist())
    return out


def test_greedy_generation_equals_transformers(smollm, transformers_greedy):
    """All prompts in one left-padded batch give, token for token, what transformers gives
    each prompt alone."""
    model, tokenizer = smollm
    with torch.no_grad():
        completions, _ = Generator(model).generate([tokenizer.encode(p) for p in PROMPTS],
                                                   NEW_TOKENS, GREEDY, None)
    assert [c.tokens for c in completions] == transformers_greedy


def until_eos(completions: list[list[int]]) -> list[list[int]]:
    """Each completion cut before the model's end-of-turn token, where ``meshtron generate``
    stops (the reference was generated past it)."""
    return [tokens[:tokens.index(EOS)] if EOS in tokens else tokens for tokens in completions]


def cli_greedy(checkpoint: Path, capfd, *layout: str, prompts: list[str] = PROMPTS,
               new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """``meshtron generate --temperature 0 --json`` tokens of every prompt, under ``layout``."""
    args = [arg for p in prompts for arg in ("--prompt", p)]
    capfd.readouterr()
    assert main(["generate", "--checkpoint", str(checkpoint), *args, "--temperature", "0",
                 "--max-new-tokens", str(new_tokens), "--json", *layout]) == 0
    rows = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.strip()]
    return [row["tokens"] for row in rows]


@pytest.mark.parametrize("layout", [("--nproc", "3", "--parallel.tp=3"),
                                    ("--nproc", "2", "--parallel.pp=2")],
                         ids=["tp3", "pp2"])
def test_generation_under_a_layout_equals_transformers(smollm_checkpoint, transformers_greedy,
                                                       capfd, layout):
    """9 heads and 3 kv heads split over tp=3 (the vocabulary of 49,152 over 3 ranks), or 30
    layers over two stages: the greedy tokens of transformers (64 of them, or up to the
    end-of-turn token where ``generate`` stops)."""
    expected = until_eos(transformers_greedy)
    assert max(len(tokens) for tokens in expected) == NEW_TOKENS
    assert cli_greedy(smollm_checkpoint, capfd, *layout) == expected


def test_default_generation_is_what_transformers_does_by_default(smollm_checkpoint,
                                                                  smollm_transformers, capfd):
    """No sampling flags: the model's own generation config (greedy; its end-of-turn token
    <|im_end|>, which the tokenizer does not call end-of-text) decides, as in transformers:
    the same tokens, ending where transformers ends."""
    model, tokenizer = smollm_transformers
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=NEW_TOKENS)[0, ids.shape[1]:].tolist()
    assert expected[-1] == 2 and len(expected) < NEW_TOKENS  # transformers stopped at EOS
    capfd.readouterr()
    assert main(["generate", "--checkpoint", str(smollm_checkpoint), "--prompt", PROMPTS[0],
                 "--max-new-tokens", str(NEW_TOKENS), "--json"]) == 0
    captured = capfd.readouterr()
    row = json.loads(captured.out)
    assert row["tokens"] == expected[:-1] and row["finish_reason"] == "eos"
    assert "sampling: greedy" in captured.err


def held_out_nll(model, tokenizer, windows: int = 6, length: int = 256) -> float:
    """Mean next-token loss over the first ``windows`` windows of the held-out text."""
    ids = tokenizer.encode(english_text(held_out=True))[: windows * (length + 1)]
    batch = torch.tensor(ids[: windows * (length + 1)]).view(windows, length + 1)
    with torch.no_grad():
        total = model.loss_sum(model(batch[:, :-1]), batch[:, 1:])
    return float(total) / (windows * length)


def test_perplexity_on_held_out_english_is_far_below_chance(smollm):
    """A pretrained model predicts English text it never saw: perplexity in the tens at most,
    where uniform guessing over 49,152 tokens gives 49,152 (random weights give about that)."""
    model, tokenizer = smollm
    perplexity = math.exp(held_out_nll(model, tokenizer))
    assert perplexity < 40, perplexity
    assert perplexity < VOCAB / 1000


FINE_TUNE = ["--train.seq_len=64", "--train.global_batch=4", "--train.log_every=1",
             "--train.eval_every=0", "--train.lr=3e-5", "--train.min_lr=3e-6",
             "--train.warmup_steps=1", "--train.weight_decay=0.0", "--run.progress=false",
             "--run.plot=false", "--checkpoint.every=0"]
EXPORT_TOKENS = 16
"""New tokens of the exported models' greedy check (their logits are compared, too)."""


def fine_tune(imported: Path, text: Path, run: Path, steps: int, *layout: str,
              start: Path | None = None) -> list[dict]:
    """``meshtron train`` from the imported weights (or from ``run``'s newest checkpoint) on
    ``text``; the per-step metrics rows."""
    resume = [f"--checkpoint.resume_from={start}"] if start else []
    assert main(["train", "--config", str(imported / "train.yaml"), *FINE_TUNE,
                 f"--data.path={text}", f"--data.cache_dir={run.parent / 'cache'}",
                 f"--run.dir={run}", f"--checkpoint.dir={run / 'checkpoints'}",
                 f"--train.steps={steps}", *resume, *layout]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"step"' in line and "event" not in line]


def load_transformers(model_dir: Path, gguf: str | None = None):
    """transformers' reading of an exported folder (or GGUF file in it): (model, tokenizer)."""
    import transformers

    if gguf:
        return transformers_from_gguf(model_dir, gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(model_dir))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference over the largest value of ``b``."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_export_is_the_model(exported, logits: torch.Tensor, ids: torch.Tensor,
                               greedy: list[int]) -> None:
    """transformers' logits of the export equal meshtron's (fp32 to 1e-5, as the import's do),
    and its greedy continuation of the first prompt is ``meshtron generate``'s."""
    model, tokenizer = exported
    with torch.no_grad():
        assert relative(model(ids).logits, logits) <= 1e-5
        prompt = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        tokens = model.generate(prompt, max_new_tokens=EXPORT_TOKENS,
                                min_new_tokens=EXPORT_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=2)
    assert until_eos([tokens[0, prompt.shape[1]:].tolist()]) == [greedy]


def test_fine_tuning_under_the_mesh_and_back_to_transformers(smollm_checkpoint, smollm, tmp_path,
                                                             capfd):
    """Continued pre-training on English text: a step at tp=3, resumed for a second at pp=2 x
    dp=2 with ZeRO-3 (the AdamW moments resharded from tp=3 to ZeRO-3 shards), equal to 2 steps
    in one process: loss and grad norm (fp32 to 1e-4), and the tuned model's logits, which the
    second step's update decides. The result exported to HF and to GGUF, where transformers
    computes the tuned model's logits (not the imported model's) and generates what ``meshtron
    generate`` does."""
    text = tmp_path / "train.txt"
    text.write_text(english_text(held_out=False)[:60_000])
    start = smollm_checkpoint / "step_00000000"
    one = fine_tune(smollm_checkpoint, text, tmp_path / "one", 2, start=start)
    run = tmp_path / "mesh"
    fine_tune(smollm_checkpoint, text, run, 1, "--nproc", "3", "--parallel.tp=3", start=start)
    mesh = fine_tune(smollm_checkpoint, text, run, 2, "--nproc", "4", "--parallel.pp=2",
                     "--parallel.zero=3")
    assert [r["step"] for r in mesh] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(one, mesh):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)
    assert mesh[-1]["loss"] < mesh[0]["loss"] + 0.05  # fine-tuning does not wreck the model
    capfd.readouterr()
    assert main(["convert", "--from", str(run), "--to", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    assert main(["convert", "--from", str(run), "--to", str(tmp_path / "tuned.gguf"),
                 "--format", "gguf"]) == 0
    tuned, tokenizer = load_for_inference(run)
    ids = torch.tensor([tokenizer.encode(english_text(held_out=True))[:48]])
    with torch.no_grad():
        logits = tuned(ids)
        moved = relative(smollm[0](ids), logits)
        same = relative(load_for_inference(tmp_path / "one")[0](ids), logits)
    assert moved > 1e-2  # the steps moved the model: measured 0.040
    # as one process moved it: measured 1.2e-5 (AdamW's first steps move a weight by about lr
    # whatever its gradient's size, so a gradient within rounding of zero counts); second
    # moments left at zero by the resume gave 0.99
    assert same <= 1e-4
    [greedy] = cli_greedy(run, capfd, prompts=PROMPTS[:1], new_tokens=EXPORT_TOKENS)
    assert_export_is_the_model(load_transformers(tmp_path / "hf"), logits, ids, greedy)
    assert_export_is_the_model(load_transformers(tmp_path, "tuned.gguf"), logits, ids, greedy)
