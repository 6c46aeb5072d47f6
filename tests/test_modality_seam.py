"""The modality seam (issue 47 item 5): a model's kind chooses its input encoders, its data
builder and its batch rows' format; the decoder, the sequence split, the pipeline executor and
the trainer carry the model's other inputs as an opaque mapping and know no modality."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.encoder_weights import ENCODER_LOADERS
from meshtron.config import load_config
from meshtron.config.kinds import KINDS, TEXT, VLA, model_kind
from meshtron.data.builders import DATA_BUILDERS, ROW_FORMATS, row_format
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize
from meshtron.models.input_encoder import InputEncoder
from meshtron.models.modalities import ENCODER_BUILDERS
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.pipeline.partition import StageLayers

ROOT = Path(__file__).resolve().parents[1] / "meshtron"
MODALITY_WORDS = re.compile(r"vla|image|vision|camera|pixel", re.IGNORECASE)


def _vla_model(**options) -> Transformer:
    cfg = load_config(overrides=["--model.preset=tiny-vla", "--model.vocab_size=300"]).model
    model = Transformer(cfg, options=ModelOptions(**options))
    initialize(model, seed=3, std=0.02, num_layers=cfg.num_layers)
    return model


def test_every_kind_has_an_entry_in_every_registry():
    """A kind added to config/kinds.py without its encoders, data builder or row format would
    fail at the first run of that kind; here it fails at once. Each kind's encoders are its
    named inputs, and each input with released weights has a loader."""
    assert set(KINDS) == {TEXT, VLA}
    for registry in (ENCODER_BUILDERS, DATA_BUILDERS, ROW_FORMATS):
        assert set(registry) == set(KINDS)
    assert set(ENCODER_LOADERS) <= {name for kind in KINDS.values() for name in kind.inputs}
    text = load_config(overrides=["--model.preset=tiny", "--model.vocab_size=300"]).model
    vla = load_config(overrides=["--model.preset=tiny-vla", "--model.vocab_size=300"]).model
    assert model_kind(text).name == TEXT and model_kind(vla).name == VLA
    assert row_format(text) is None and row_format(vla) is not None
    assert Transformer(text).input_encoders() == {}
    encoders = Transformer(vla).input_encoders()
    assert list(encoders) == list(model_kind(vla).inputs) == ["vision"]
    assert all(isinstance(e, InputEncoder) for e in encoders.values())


def test_the_encoder_lives_on_the_first_stage_under_its_input_name():
    """Parameter names stay ``vision.*`` (checkpoints, init and the HF import key on them); a
    pipeline stage without the embedding holds no encoder."""
    first = _vla_model(stage=StageLayers(((0,),), True, False))
    last = _vla_model(stage=StageLayers(((1,),), False, True))
    assert "vision.patch_embed.weight" in dict(first.named_parameters())
    assert last.input_encoders() == {}
    assert not any(name.startswith("vision.") for name, _ in last.named_parameters())


def test_rows_unpack_into_named_inputs_and_unknown_inputs_are_refused():
    """The split hands the row format's inputs to the model untouched; an input no encoder
    reads (a misspelt name) is one clear line, not silently dropped."""
    model = _vla_model()
    v = model.cfg.vision
    images = torch.randint(0, 256, (2, *v.image_shape), dtype=torch.uint8)
    window = torch.randint(1, 300, (2, v.seq_len + 1))
    rows = torch.cat([window, images.reshape(2, -1).long()], dim=1)
    mb = SequenceSplit(ParallelMesh.single().cp, rows=row_format(model.cfg))(rows)
    assert torch.equal(mb.inputs["vision"], images) and torch.equal(mb.tokens, window[:, :-1])
    with torch.no_grad():
        logits = model(mb.tokens, inputs=mb.inputs)
        assert not torch.equal(logits, model(mb.tokens))  # the images were placed
        with pytest.raises(MeshtronError, match="no input encoder for images"):
            model(mb.tokens, inputs={"images": images})


def test_no_modality_words_in_the_parallel_layers_or_the_trainer():
    """The context-parallel split, the pipeline and the tensor layers take generic inputs, and
    the trainer asks the registries; a modality test creeping back into them fails here."""
    files = [*sorted((ROOT / "parallel").rglob("*.py")), ROOT / "training" / "trainer.py"]
    found = {str(f.relative_to(ROOT)): sorted({m.group(0).lower() for m in
                                               MODALITY_WORDS.finditer(f.read_text())})
             for f in files}
    assert {f: words for f, words in found.items() if words} == {}


def test_environments_are_made_by_name():
    """The environment seam issue 49 builds on: a Gymnasium environment from its name, with the
    observation every policy reads; an unknown name is one line naming the known ones."""
    import gymnasium as gym

    from meshtron.envs import make_env

    env = make_env("tabletop", image_size=32)
    assert isinstance(env, gym.Env)
    obs, info = env.reset(seed=5)
    assert obs["image"].shape == (32, 32, 3) and obs["instruction"] and "success" in info
    assert env.action_space.shape == (3,)
    with pytest.raises(MeshtronError, match="unknown environment 'nosuch'; the "
                                            "environments are tabletop, metaworld-mt10, "):
        make_env("nosuch")
