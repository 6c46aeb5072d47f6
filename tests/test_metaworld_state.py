"""The proprioceptive state as a policy input (issue 49): recorded in episode datasets, carried
bit for bit in batch rows, projected into one token right before the actions, refused in one
line where there is none. Hand-made episodes, no MuJoCo: fast."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from meshtron.config import load_config
from meshtron.config.kinds import STATE, VISION
from meshtron.data.builders import row_format
from meshtron.data.episodes import Episode, EpisodeDataset, write_episodes
from meshtron.data.vla_data import build_policy_data
from meshtron.envs import env_spec
from meshtron.envs.metaworld_tasks import phrasings, vocabulary
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize
from meshtron.models.state_encoder import state_parameters
from meshtron.models.transformer import Transformer
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh
from tests.test_vla import vla_overrides

TWO = "metaworld:reach-v3+push-v3"


def _episodes(states: bool, count: int = 3, size: int = 32) -> list[Episode]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        steps = 6 + i
        out.append(Episode(
            rng.integers(0, 256, (steps, size, size, 3), dtype=np.uint8),
            rng.uniform(-1, 1, (steps, 4)).astype(np.float32),
            phrasings(("reach-v3", "push-v3")[i % 2], False)[0], 10 + i, True,
            rng.normal(0.3, 0.2, (steps, 4)).astype(np.float32) if states else None))
    return out


def _write(path, states: bool) -> str:
    write_episodes(path, _episodes(states), env=env_spec(TWO).dataset_env, words=vocabulary())
    return str(path)


def _overrides(demos: str, tmp_path, state_dims: int = 4) -> list[str]:
    return [*vla_overrides(demos, str(tmp_path / "cache"), str(tmp_path / "run")),
            f"--model.vision.env={TWO}", "--model.vision.action_dims=4",
            f"--model.vision.state_dims={state_dims}", "--data.valid_fraction=0.34"]


def test_states_round_trip_and_older_sets_read_as_stateless(tmp_path):
    """Written states read back exactly; a set without them (or an index from before
    ``state_dims``) has none; a set mixing the two is refused."""
    written = _episodes(True)
    dataset = EpisodeDataset.open(_write(tmp_path / "with", True))
    assert dataset.state_dims == 4 and dataset.index["state_dims"] == 4
    for i, episode in enumerate(written):
        assert np.array_equal(dataset[i].states, episode.states)
    plain = tmp_path / "plain"
    _write(plain, False)
    index = json.loads((plain / "episodes.json").read_text())
    del index["state_dims"]  # as sets written before states were recorded
    (plain / "episodes.json").write_text(json.dumps(index))
    old = EpisodeDataset.open(plain)
    assert old.state_dims == 0 and old.states is None and old[0].states is None
    with pytest.raises(MeshtronError, match="states of 0 entries after 4"):
        write_episodes(tmp_path / "mixed", [written[0], _episodes(False)[1]], env="x")


def test_the_state_token_sits_before_the_actions_and_reaches_them(tmp_path):
    """Rows carry the float32 state bit for bit; the window gains one read-only position right
    before the actions; changing the state changes the logits from that position on and
    leaves every earlier one alone (it is placed there, and only there)."""
    cfg = load_config(overrides=_overrides(_write(tmp_path / "d", True), tmp_path))
    data = build_policy_data(cfg, log=lambda m: None)
    v = data.vision
    position = v.num_patches + v.instruction_len + v.readout_tokens
    assert v.state_token_positions == [position]
    assert cfg.train.seq_len == v.seq_len == position + v.action_tokens
    rows = data.train_batch(0, 4)
    mb = SequenceSplit(ParallelMesh.single().cp, rows=row_format(cfg.model))(rows)
    assert set(mb.inputs) == {VISION, STATE}
    assert torch.equal(mb.inputs[STATE], torch.from_numpy(data.train.states[
        data._samplers[4].batch_indices(0)]))
    assert bool((mb.targets[:, :position] < 0).all())
    assert bool((mb.targets[:, position:] >= 0).all())
    model = Transformer(dataclasses.replace(data.resolved(cfg).model,
                                            vocab_size=data.tokenizer.vocab_size))
    initialize(model, seed=1, std=0.05, num_layers=cfg.model.num_layers)
    assert state_parameters(v, cfg.model.hidden_size) == sum(
        p.numel() for name, p in model.named_parameters() if name.startswith("state."))
    with torch.no_grad():
        base = model(mb.tokens, inputs=mb.inputs)
        moved = dict(mb.inputs, **{STATE: mb.inputs[STATE] + 0.5})
        other = model(mb.tokens, inputs=moved)
    assert torch.equal(base[:, :position], other[:, :position])
    assert (base[:, position:] - other[:, position:]).abs().max() > 1e-3


def test_no_state_to_read_is_one_line(tmp_path):
    """A policy reading the state on a set without one, or on an environment that has none."""
    cfg = load_config(overrides=_overrides(_write(tmp_path / "d", False), tmp_path))
    with pytest.raises(MeshtronError, match="records 0 state entries per frame, but "
                                            "model.vision.state_dims=4"):
        build_policy_data(cfg, log=lambda m: None)
    with pytest.raises(MeshtronError, match="tabletop observes a 0-entry state"):
        load_config(overrides=["--model.preset=tiny-vla", "--model.vision.state_dims=2"])


def test_the_startup_line_counts_the_state_encoder():
    from meshtron.plan import plan_run
    from meshtron.training.startup_report import run_lines

    cfg = load_config(overrides=["--model.preset=tiny-vla", "--model.vocab_size=64",
                                 "--model.vision.env=metaworld-mt10",
                                 "--model.vision.action_dims=4", "--model.vision.state_dims=4"])
    line = next(line for line in run_lines(cfg, plan_run(cfg, 1), 64)
                if line.startswith("vision:"))
    size = state_parameters(cfg.model.vision, cfg.model.hidden_size)
    assert size > 0 and f"4-value state as one token ({size / 1e3:.1f}K parameters)" in line
