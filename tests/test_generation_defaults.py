"""Generation defaults from the model (issue 45 item 7): `convert` keeps an HF folder's
generation config in the checkpoint's ``generation`` section, `generate` and `serve` sample with
it (greedy when the model states nothing, as transformers), flags and request fields win, the
start-up line says which sampling and where from, `--help` shows every default, and export
writes the section back as generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtron.checkpoint.hf_convert import convert
from meshtron.checkpoint.loading import open_for_inference
from meshtron.cli import build_parser, main
from meshtron.inference.sampling_defaults import choose_sampling
from meshtron.models.generation import Sampling
from tests.test_hf_convert import cli_error, hf_folder, meshtron_checkpoint

SAMPLES = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9,
           "max_new_tokens": 6, "eos_token_id": [0, 5], "repetition_penalty": 1.1}


def imported(tmp_path: Path, generation: dict | None, name: str = "ck") -> Path:
    """An HF folder (a seeded tiny llama with a word-level tokenizer) with ``generation`` as
    its generation_config.json (None: none), imported into ``tmp_path / name``."""
    folder = tmp_path / f"hf-{name}"
    if not folder.exists():
        _, _, ckpt = meshtron_checkpoint(tmp_path / f"src-{name}", tokenizer=True)
        convert(ckpt, folder, "hf")
        (folder / "generation_config.json").unlink()
        if generation is not None:
            (folder / "generation_config.json").write_text(json.dumps(generation))
    convert(folder, tmp_path / name)
    return tmp_path / name


def generate(capsys, checkpoint: Path, *flags: str) -> tuple[list[list[int]], list[str]]:
    """`meshtron generate --json` in-process: each prompt's tokens, and the stderr lines."""
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "the quick",
                 "--prompt", "a lazy dog", "--json", *flags]) == 0
    out, err = capsys.readouterr()
    return [json.loads(line)["tokens"] for line in out.splitlines()], err.splitlines()


def sampling_line(err: list[str]) -> str:
    (line,) = [line for line in err if line.startswith("sampling: ")]
    return line


def test_import_keeps_the_models_generation_config(tmp_path):
    gen = open_for_inference(imported(tmp_path, SAMPLES)).config.generation
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.top_p) == (True, 0.7, 20, 0.9)
    assert (gen.max_new_tokens, gen.eos_token_id, gen.source) == (6, [0, 5],
                                                                  "generation_config.json")
    assert choose_sampling(gen).sampling == Sampling(0.7, 20, 0.9)
    # what the file leaves out is transformers' default: top-k 50, top-p 1
    sparse = open_for_inference(imported(tmp_path, {"do_sample": True}, "sparse")).config
    assert choose_sampling(sparse.generation).sampling == Sampling(1.0, 50, 1.0)


def test_a_model_without_generation_config_is_greedy(tmp_path):
    gen = open_for_inference(imported(tmp_path, None)).config.generation
    assert (gen.do_sample, gen.source) == (False, "none")
    assert choose_sampling(gen).sampling.temperature == 0
    said = open_for_inference(imported(tmp_path, {"do_sample": False, "top_k": 7}, "off"))
    assert choose_sampling(said.config.generation).sampling.temperature == 0


def test_convert_names_settings_meshtron_does_not_apply(tmp_path):
    _, _, ckpt = meshtron_checkpoint(tmp_path / "src", tokenizer=True)
    convert(ckpt, tmp_path / "hf", "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(SAMPLES))
    notes = convert(tmp_path / "hf", tmp_path / "ck").notes
    assert any("repetition_penalty=1.1" in note and "not apply" in note for note in notes)


def test_generate_on_a_greedy_model_equals_temperature_0(tmp_path, capsys):
    checkpoint = imported(tmp_path, None)
    default, err = generate(capsys, checkpoint, "--max-new-tokens", "8")
    greedy, _ = generate(capsys, checkpoint, "--max-new-tokens", "8", "--temperature", "0")
    sampled, _ = generate(capsys, checkpoint, "--max-new-tokens", "8", "--temperature", "0.8")
    assert default == greedy != sampled  # the old defaults (0.8, 50, 0.95) sampled
    assert sampling_line(err) == ("sampling: greedy (the imported model states no generation "
                                  "settings: transformers' defaults)")


def test_generate_samples_as_the_model_says_and_flags_win(tmp_path, capsys):
    checkpoint = imported(tmp_path, SAMPLES)
    default, err = generate(capsys, checkpoint)
    explicit, _ = generate(capsys, checkpoint, "--temperature", "0.7", "--top-k", "20",
                           "--top-p", "0.9", "--max-new-tokens", "6")
    assert default == explicit and all(len(t) <= 6 for t in default)
    assert any(len(t) == 6 for t in default)  # the model's max_new_tokens, not 100
    assert sampling_line(err) == ("sampling: temperature 0.7, top-k 20, top-p 0.9 (from the "
                                  "model's generation_config.json)")
    greedy, err = generate(capsys, checkpoint, "--temperature", "0", "--top-k", "3")
    assert sampling_line(err) == ("sampling: greedy (--temperature); --top-k applies only "
                                  "when sampling (a temperature above 0)")
    _, err = generate(capsys, checkpoint, "--top-p", "0.5")
    assert sampling_line(err) == ("sampling: temperature 0.7, top-k 20, top-p 0.5 (--top-p); "
                                  "others: from the model's generation_config.json")


def test_a_model_meshtron_trained_keeps_its_defaults(tmp_path, capsys):
    _, _, ckpt = meshtron_checkpoint(tmp_path / "ck", tokenizer=True)
    gen = open_for_inference(ckpt).config.generation
    assert choose_sampling(gen).sampling == Sampling(0.8, 50, 0.95)
    _, err = generate(capsys, ckpt, "--max-new-tokens", "2")
    assert sampling_line(err) == ("sampling: temperature 0.8, top-k 50, top-p 0.95 (meshtron's "
                                  "defaults for a model it trained)")


def test_help_shows_every_default():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    flags = {"generate": ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                          "--nproc"),
             "serve": ("--temperature", "--top-k", "--top-p", "--max-batch", "--port")}
    for command, names in flags.items():
        helps = {a.option_strings[-1]: a.help for a in subcommands[command]._actions}
        for name in names:
            assert "default" in helps[name], (command, name)
    text = subcommands["generate"].format_help()
    assert "a model meshtron trained: 0.8" in " ".join(text.split())


def test_export_writes_the_generation_config_back(tmp_path):
    checkpoint = imported(tmp_path, SAMPLES)
    convert(checkpoint, tmp_path / "out", "hf")
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9,
                       "max_new_tokens": 6, "eos_token_id": [0, 5]}
    convert(tmp_path / "out", tmp_path / "again")
    back = open_for_inference(tmp_path / "again").config.generation
    assert back == open_for_inference(checkpoint).config.generation
    convert(imported(tmp_path, None, "greedy"), tmp_path / "greedy-out", "hf")
    greedy = json.loads((tmp_path / "greedy-out" / "generation_config.json").read_text())
    assert greedy == {"do_sample": False, "eos_token_id": 0}  # no sampling fields beside it


@pytest.mark.parametrize("generation,message", [
    ({"do_sample": True, "temperature": "hot"}, "temperature must be a number"),
    ({"do_sample": True, "top_p": 1.5}, "top_p must lie in (0, 1]"),
    ({"eos_token_id": [1, -2]}, "eos_token_id must be a token id"),
])
def test_a_bad_generation_config_is_one_line(tmp_path, capsys, generation, message):
    folder = hf_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    line = cli_error(capsys, "convert", "--from", folder, "--to", tmp_path / "out")
    assert "generation_config.json" in line and message in line
    assert not (tmp_path / "out").exists()


def test_serve_requests_without_sampling_fields_get_the_models_defaults(tmp_path, capsys):
    from fastapi.testclient import TestClient

    from meshtron.checkpoint.loading import load_for_inference
    from meshtron.inference.engine import Engine
    from meshtron.inference.server import build_app
    from meshtron.models.generation import Generator

    checkpoint = imported(tmp_path, None)
    greedy, _ = generate(capsys, checkpoint, "--max-new-tokens", "5", "--temperature", "0")
    ckpt = open_for_inference(checkpoint)
    model, _ = load_for_inference(checkpoint)
    engine = Engine(Generator(model), ckpt.tokenizer, max_batch=4)
    defaults = choose_sampling(ckpt.config.generation).sampling
    engine.start()
    try:
        with TestClient(build_app(engine, ckpt.tokenizer, "m", defaults=defaults)) as client:
            texts = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 5}).json()
                     ["choices"][0]["text"] for p in ("the quick", "a lazy dog")]
    finally:
        engine.close()
    assert texts == [ckpt.tokenizer.decode(tokens) for tokens in greedy]
