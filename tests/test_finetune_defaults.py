"""Fine-tuning defaults (issue 45 item 4, issue 51 item 3): the train.yaml that `meshtron convert`
writes for an imported model holds a fine-tuning schedule (meshtron/config/finetune.py), explicit
settings win over it, and a run that starts from the imported (weights-only) checkpoint says
which schedule it uses, warning when it is the from-scratch one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from meshtron.checkpoint.hf_convert import convert
from meshtron.config import TrainConfig, load_config
from meshtron.config.finetune import FINETUNE_TRAIN
from meshtron.training.finetune_start import finetune_report
from meshtron.training.trainer import Trainer
from tests.test_hf_convert import WORDS, meshtron_checkpoint

FINETUNE_LINE = ("fine-tuning defaults: lr 3e-05 after a 10-step warm-up, cosine decay to 3e-06 "
                 "by step 3, weight decay 0 (the weights are pretrained; set train.lr, min_lr, "
                 "warmup_steps, weight_decay to change them)")


def imported(tmp_path: Path) -> Path:
    """A tiny llama (word-level tokenizer) exported to HF and imported back: its train.yaml."""
    _, _, ckpt = meshtron_checkpoint(tmp_path / "src", tokenizer=True)
    convert(ckpt, tmp_path / "hf", "hf")
    convert(tmp_path / "hf", tmp_path / "imported")
    return tmp_path / "imported" / "train.yaml"


def test_convert_writes_finetuning_defaults_and_explicit_settings_win(tmp_path):
    train_yaml = imported(tmp_path)
    assert train_yaml.read_text().startswith("# Written by `meshtron convert`")
    t = load_config(train_yaml).train
    assert {key: getattr(t, key) for key in FINETUNE_TRAIN} == FINETUNE_TRAIN
    assert t.lr < TrainConfig().lr / 50 and t.warmup_steps < TrainConfig().warmup_steps
    t = load_config(train_yaml, ["--train.lr=1e-4", "--train.weight_decay=0.01"]).train
    assert (t.lr, t.weight_decay, t.warmup_steps) == (1e-4, 0.01, 10)


def test_the_report_names_the_schedule_and_warns_on_the_from_scratch_one():
    said: list[str] = []
    warned: list[str] = []
    finetune = TrainConfig(steps=3, **FINETUNE_TRAIN)
    finetune_report({}, finetune, said.append, warned.append)
    assert said == [FINETUNE_LINE] and warned == []
    finetune_report({}, TrainConfig(), said.append, warned.append)
    (warning,) = warned
    assert "from-scratch schedule (lr 0.003 after a 20-step warm-up" in warning
    assert "--train.lr=3e-05 --train.min_lr=3e-06 --train.warmup_steps=10" in warning
    finetune_report({}, TrainConfig(lr=1e-4, min_lr=1e-5, warmup_steps=5, weight_decay=0.0),
                    said.append, warned.append)
    assert said[-1].startswith("fine-tuning settings: lr 0.0001 after a 5-step warm-up")
    finetune_report({"optimizer": {"steps": 4}}, TrainConfig(), said.append, warned.append)
    assert len(said) == 2 and len(warned) == 1  # a checkpoint training wrote: nothing to say


def test_a_run_from_imported_weights_uses_and_says_the_finetuning_schedule(tmp_path):
    train_yaml = imported(tmp_path)
    text = tmp_path / "text.txt"
    words = random.Random(0).choices(WORDS, k=4000)
    text.write_text("\n".join(" ".join(words[i:i + 20]) for i in range(0, len(words), 20)))
    overrides = [f"--data.path={text}", f"--data.cache_dir={tmp_path / 'cache'}",
                 "--train.seq_len=16", "--train.global_batch=2", "--train.steps=3",
                 "--train.eval_every=0", "--train.log_every=1", "--run.progress=false",
                 "--run.plot=false", "--train.peak_flops=1e12"]
    said: list[str] = []
    Trainer(load_config(train_yaml, overrides), log=said.append).run()
    assert FINETUNE_LINE in said
    rows = [json.loads(line) for line in (tmp_path / "imported" / "metrics.jsonl").open()]
    assert [row["lr"] for row in rows] == [3e-6, 6e-6, 9e-6]  # the 10-step warm-up to 3e-5
    said.clear()  # resumed from its own checkpoint (optimizer state kept): nothing to say
    Trainer(load_config(train_yaml, [*overrides, "--train.steps=4"]), log=said.append).run()
    assert not any("fine-tuning" in line for line in said)
