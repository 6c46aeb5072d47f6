"""Vision-language-action policies: observation windows, training under the mesh with parity,
the policy's cached decoding, closed-loop evaluation and its bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.data.builders import row_format
from meshtron.data.demonstrations import generate_demonstrations
from meshtron.data.vla_data import build_policy_data, encode_instruction
from meshtron.data.vla_tokens import ActionCodec, vla_tokenizer
from meshtron.envs import TabletopEnv
from meshtron.envs.tabletop import MAX_STEP, block_under
from meshtron.errors import MeshtronError
from meshtron.inference.policy_eval import EVAL_SEED_BASE, Evaluation, rollouts
from meshtron.models.init import initialize
from meshtron.models.policy_runner import PolicyRunner
from meshtron.models.transformer import Transformer
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh
from tests.parity import (
    FP64_STEPS,
    STEPS,
    assert_layouts_match_reference,
    run_each,
    run_layout,
)


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> str:
    """40 demonstrations at 32x32 (a second or two to write)."""
    path = tmp_path_factory.mktemp("vla") / "demos"
    generate_demonstrations(40, 7, 32, path, log=lambda m: None)
    return str(path)


def vla_overrides(demos: str, cache_dir: str, run_dir: str, steps: int = STEPS) -> list[str]:
    """tiny-vla shrunk: a 2-layer, 64-wide decoder and a 1-block, 32-wide encoder."""
    return [
        "--model.preset=tiny-vla", "--model.num_layers=2", "--model.hidden_size=64",
        "--model.num_heads=4", "--model.num_kv_heads=4", "--model.ffn_hidden_size=128",
        "--model.vision.hidden_size=32", "--model.vision.num_layers=1",
        "--model.vision.num_heads=2", "--model.vision.ffn_hidden_size=64",
        f"--data.path={demos}", f"--data.cache_dir={cache_dir}", "--data.valid_fraction=0.1",
        "--train.global_batch=8", f"--train.steps={steps}", "--train.lr=0.003",
        "--train.warmup_steps=2", "--train.eval_every=0", "--train.log_every=5",
        "--run.progress=false", "--run.plot=false", "--checkpoint.resume=false",
        f"--run.dir={run_dir}",
    ]


def test_observation_windows_read_everything_and_predict_only_actions(demos, tmp_path):
    cfg = load_config(overrides=vla_overrides(demos, str(tmp_path), str(tmp_path / "run")))
    data = build_policy_data(cfg, log=lambda m: None)
    v = data.vision
    assert cfg.train.seq_len == (v.num_patches + v.instruction_len + v.readout_tokens
                                 + v.action_tokens - 1) == 30
    assert v.action_low is not None and len(v.action_low) == v.action_dims
    batch = data.train_batch(0, 8)
    assert batch.shape == (8, 31 + 32 * 32 * 3)
    assert torch.equal(batch, data.train_batch(0, 8))  # a function of (seed, k)
    mb = SequenceSplit(ParallelMesh.single().cp, rows=row_format(cfg.model))(batch)
    assert list(mb.inputs) == ["vision"]
    assert mb.inputs["vision"].shape == (8, 32, 32, 3) and mb.inputs["vision"].dtype == torch.uint8
    assert (mb.tokens >= 0).all() and (mb.tokens[:, :v.num_patches] == 0).all()
    predicted = mb.targets >= 0
    assert predicted.sum(dim=1).tolist() == [v.action_tokens] * 8  # the actions alone
    assert predicted[:, -v.action_tokens:].all()
    first = data.codec.first_id
    assert ((mb.targets[predicted] >= first) & (mb.targets[predicted] < first + 256)).all()
    # the instruction is read where the window says, and decodes to the episode's words
    instruction = mb.tokens[0, v.num_patches:v.num_patches + v.instruction_len].tolist()
    words = data.tokenizer.decode(t for t in instruction if t)
    assert words.split()[-1] in ("block", "cube") and "<a" not in words
    with pytest.raises(MeshtronError, match="outside the policy's vocabulary"):
        encode_instruction(data.tokenizer, "pick up the purple elephant", v.instruction_len)


def test_action_tokens_decode_to_their_bin_centres_and_round_trip_within_half_a_bin(tmp_path):
    """OpenVLA's binning over each dimension's own range: known ids give known centres, every
    in-range action comes back within half a bin of itself, a centre encodes to its own id."""
    bins, low, high = 4, (-1.0, 0.0, -2.0), (1.0, 1.0, 2.0)
    codec = ActionCodec.of(vla_tokenizer(["pick", "cube"], bins, tmp_path), low, high, bins)
    first = codec.first_id
    assert first == 4  # <pad>, end of text, the two words, then <a000>
    ids = np.array([[first, first + 1, first + 3], [first + 3, first + 2, first]])
    assert codec.decode(ids).tolist() == [[-0.75, 0.375, 1.5], [0.75, 0.625, -1.5]]
    assert (codec.encode(codec.decode(ids)) == ids).all()
    actions = np.random.default_rng(0).uniform(low, high, size=(1000, 3))
    back = codec.decode(codec.encode(actions))
    half_bin = (np.array(high) - np.array(low)) / bins / 2
    assert (np.abs(back - actions) <= half_bin * (1 + 1e-6)).all()
    assert (codec.encode(np.array([low, high])) == [[first] * 3, [first + bins - 1] * 3]).all()


def test_cached_action_decoding_equals_the_full_forward():
    cfg = load_config(overrides=["--model.preset=tiny-vla", "--model.vocab_size=300"]).model
    model = Transformer(cfg)
    initialize(model, seed=3, std=0.02, num_layers=cfg.num_layers)
    runner = PolicyRunner(model, first_action_id=40)
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    instructions = torch.randint(2, 20, (2, cfg.vision.instruction_len))
    actions = runner.act(images, instructions)
    assert actions.shape == (2, 3) and ((actions >= 40) & (actions < 296)).all()
    prefix = torch.cat([torch.zeros(2, cfg.vision.num_patches, dtype=torch.long),
                        instructions, torch.zeros(2, 1, dtype=torch.long), actions[:, :-1]],
                       dim=1)
    logits = model(prefix, inputs={"vision": images})[:, -3:, 40:296]
    assert torch.equal(logits.argmax(-1) + 40, actions)
    # the images matter: other pixels, other patch embeddings in the first positions
    other = model(prefix, inputs={"vision": 255 - images})
    assert not torch.allclose(other[:, :16], model(prefix, inputs={"vision": images})[:, :16])


def test_image_tokens_go_to_the_patches_and_the_readout_position():
    """The encoder's 16 patch tokens fill positions 0..15 and its readout token the position
    after the instruction (27); the instruction's words query the readout; a later window
    without the instruction but with the readout position is refused in one line."""
    cfg = load_config(overrides=["--model.preset=tiny-vla", "--model.vocab_size=300"]).model
    model = Transformer(cfg)
    initialize(model, seed=3, std=0.02, num_layers=cfg.num_layers)
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    ids = torch.randint(1, 300, (2, 30))
    with torch.no_grad():
        tokens = model.vision(images, ids[:, 16:27])
        placed = model.place_inputs(torch.zeros(2, 30, 128), {"vision": images}, 0, ids)
        other = model.place_inputs(torch.zeros(2, 30, 128), {"vision": images}, 0, ids.flip(1))
    assert cfg.vision.image_token_positions == [*range(16), 27] and tokens.shape[1] == 17
    assert torch.equal(placed[:, :16], tokens[:, :16]) and torch.equal(placed[:, 27], tokens[:, 16])
    assert not placed[:, 16:27].any() and not placed[:, 28:].any()
    assert torch.equal(other[:, :16], placed[:, :16]) and not torch.equal(other[:, 27],
                                                                          placed[:, 27])
    with pytest.raises(MeshtronError, match="instruction in the same forward call"):
        model.place_inputs(torch.zeros(2, 10, 128), {"vision": images}, 20, ids[:, 20:])


def _vla_layouts(rank: int, world_size: int, demos: str, cache_dir: str, root: str,
                 layouts: list[list[str]]) -> list[dict]:
    return run_each([vla_overrides(demos, cache_dir, f"{root}/layout{i}") + layout
                     for i, layout in enumerate(layouts)], rank, world_size)


@pytest.mark.slow
def test_policy_training_keeps_parity_under_tp_sp_pp_and_zero1(demos, tmp_path):
    """tp=2 with sp (encoder heads and MLP split, the decoder's sequence split after the
    image patches are placed), pp=2 with the encoder on stage 0, dp=2 with ZeRO-1: per-step
    loss and grad norm of the one-process run (fp32 at 1e-4, fp64 at 1e-9)."""
    from tests.distributed import run_distributed

    cache = str(tmp_path / "cache")
    layouts = [["--parallel.tp=2", "--parallel.sp=true"],
               ["--parallel.pp=2", "--train.micro_batch=2"],
               ["--parallel.zero=1"]]
    results = run_distributed(_vla_layouts, 2, demos, cache, str(tmp_path), layouts)
    reference = run_layout(vla_overrides(demos, cache, str(tmp_path / "ref")))
    assert len(reference["loss"]) == STEPS and len(reference["fp64"]["loss"]) == FP64_STEPS
    assert reference["loss"][-1] < reference["loss"][0]  # it learns
    assert_layouts_match_reference(reference, layouts, results)  # every layout checked


@pytest.mark.slow
def test_evaluate_rolls_the_policy_out_and_reports(demos, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *vla_overrides(demos, str(tmp_path / "cache"), str(run), steps=4)]) == 0
    out = tmp_path / "eval.json"
    code = main(["evaluate", "--checkpoint", str(run), "--episodes", "6", "--json", str(out),
                 "--video", str(tmp_path / "videos"), "--videos", "2"])
    assert code == 0
    summary = json.loads(out.read_text())
    assert summary["episodes"] == 6 == sum(summary["outcomes"].values())
    assert summary["outcomes"]["success"] == round(6 * summary["success_rate"])
    assert 0.0 <= summary["success_rate"] <= 1.0
    assert 0.0 <= summary["action_token_accuracy"] <= 1.0
    assert summary["control_steps_per_s"] > 0
    gifs = sorted((tmp_path / "videos").glob("*.gif"))
    assert len(gifs) == 2
    assert "success rate" in capsys.readouterr().out


def go_and_close(where):
    """A script: move at full speed to ``where(state)``, closing on the step that lands there."""
    def act(state):
        delta = np.array(where(state)) - np.array(state.gripper)
        grip = 1.0 if np.abs(delta).max() <= MAX_STEP else -1.0
        return np.array([*np.clip(delta / MAX_STEP, -1, 1), grip], dtype=np.float32)
    return act


def bare_table(state):
    return next((x / 20, y / 20) for x in range(21) for y in range(21)
                if block_under(state, x / 20, y / 20) is None)


EPISODE_SCRIPTS = {
    "success": go_and_close(lambda s: (s.target_block.x, s.target_block.y)),
    "other_block": go_and_close(lambda s: (s.blocks[(s.target + 1) % len(s.blocks)].x,
                                           s.blocks[(s.target + 1) % len(s.blocks)].y)),
    "table": go_and_close(bare_table),
    "timeout": lambda state: np.array([0.0, 0.0, -1.0], dtype=np.float32),  # never closes
}


class ScriptedActor:
    """Plays a script per evaluation episode in twins of its environments (the same seeds and
    actions, so the same states): hand-made episodes of each ending, no trained policy."""

    def __init__(self, scripts, image_size: int):
        self.scripts, self.twins = scripts, []
        for i in range(len(scripts)):
            env = TabletopEnv(image_size=image_size)
            self.twins.append([env, env.reset(seed=EVAL_SEED_BASE + i)[0]["image"]])
        self.running = list(range(len(scripts)))

    def __call__(self, images, instructions, states=None):
        assert len(images) == len(self.running)
        actions, still = [], []
        for i, image in zip(self.running, images, strict=True):
            env, seen = self.twins[i]
            assert np.array_equal(seen, image)  # the twin is where the episode is
            actions.append(self.scripts[i](env.state))
            obs, _, closed, truncated, _ = env.step(actions[-1])
            self.twins[i][1] = obs["image"]
            if not (closed or truncated):
                still.append(i)
        self.running = still
        return np.stack(actions)[:, None, :]  # chunks of one action


def test_evaluation_counts_only_closing_on_the_named_block_as_success():
    """Four hand-made episodes, one of each ending: only the one that closed over the named
    block is a success (closing over another block or bare table ends the episode as well,
    and is a failure); the summary counts each ending once."""
    kinds = list(EPISODE_SCRIPTS)
    episodes = rollouts(ScriptedActor([EPISODE_SCRIPTS[k] for k in kinds], 32), len(kinds), 32)
    assert [e.outcome for e in episodes] == kinds
    assert [e.success for e in episodes] == [True, False, False, False]
    assert [e.episode_return for e in episodes] == [1.0, 0.0, 0.0, 0.0]
    assert episodes[-1].steps == TabletopEnv().max_steps
    summary = Evaluation(episodes, action_token_accuracy=0.5, latency_s=0.01).summary()
    assert summary["success_rate"] == 0.25 and summary["episodes"] == 4
    assert summary["outcomes"] == {"success": 1, "other_block": 1, "table": 1, "timeout": 1}


def test_bad_vla_input_is_one_line(demos, tmp_path, capsys, tiny_overrides):
    cache = str(tmp_path / "cache")
    cases = [
        (["--model.vision.image_size=30"], "not divisible by model.vision.patch_size"),
        (["--model.vision.image_size=64"], "holds 32x32 images"),
        (["--model.vision.action_dims=2"], "3-dimensional actions"),
        (["--train.seq_len=64"], "a vision model's window is 30 tokens"),
        (["--parallel.cp=2"], "does not combine with model.vision"),
        (["--model.mtp_depth=1"], "model.mtp_depth does not combine with model.vision"),
        (["--data.document_mask=true"], "are for text; an observation window"),
        (["--train.eval_generate=2"], "measured in closed loop by meshtron evaluate"),
        (["--model.vision.action_low=-1,-1,-1"], "are set together"),
        (["--model.vision.action_low=-1,-1", "--model.vision.action_high=1,1"],
         "has 2 values for 3 action dimensions"),
        (["--model.vision.action_low=1,-1,-1", "--model.vision.action_high=1,1,1"],
         "must be below action_high"),
        (["--model.vision.action_bins=1"], "action_bins must be at least 2"),
        (["--model.vision.instruction_keypoints=-1"], "instruction_keypoints must not be negative"),
    ]
    for extra, message in cases:
        code = main(["train", *vla_overrides(demos, cache, str(tmp_path / "run")), *extra,
                     *(["--nproc=2"] if "cp" in extra[0] else [])])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (extra, err)
    data = build_policy_data(load_config(overrides=vla_overrides(demos, cache, "unused")),
                             log=lambda m: None)
    with pytest.raises(MeshtronError, match="more than model.vision.instruction_len=2"):
        encode_instruction(data.tokenizer, "grab the red cube", 2)
    with pytest.raises(MeshtronError, match="has no 300 action tokens"):
        ActionCodec.of(data.tokenizer, [-1.0], [1.0], 300)
    text = [o for o in tiny_overrides if not o.startswith("--train.steps=")]
    assert main(["train", *text, "--train.steps=1"]) == 0
    run = next(o.split("=", 1)[1] for o in text if o.startswith("--run.dir="))
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", run, "--episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert "is a text model's checkpoint" in err and "Traceback" not in err


def test_a_pretrained_siglip_tower_starts_the_encoder(demos, tmp_path):
    """``model.vision.pretrained``: the trainer's encoder is the Hugging Face tower's (the
    projector and the decoder stay drawn from the seed)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from meshtron.training.trainer import Trainer

    tower = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8, layer_norm_eps=1e-6)).eval()
    tower.save_pretrained(tmp_path / "siglip")
    overrides = vla_overrides(demos, str(tmp_path / "cache"), str(tmp_path / "run"))
    trainer = Trainer(load_config(overrides=[*overrides,
                                             f"--model.vision.pretrained={tmp_path}/siglip"]),
                      log=lambda m: None)
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        expected = tower(pixel_values=pixels).last_hidden_state
        got = trainer.model.vision.encode(pixels)
    assert torch.allclose(got, expected, atol=1e-5)
    with pytest.raises(MeshtronError, match="lacks|differ|does not match|not"):
        Trainer(load_config(overrides=[*overrides, "--model.vision.hidden_size=64",
                                       "--model.vision.ffn_hidden_size=128",
                                       f"--model.vision.pretrained={tmp_path}/siglip"]),
                log=lambda m: None)


def test_the_encoder_starts_knowing_where_each_patch_is():
    """Its positions start as a 2-D sine-cosine grid and its patch embedding as LeCun normal:
    with both at std 0.02 the policy took thousands of steps to read positions (docs/vla.md)."""
    from meshtron.models.init import grid_positions, initial_value

    table = grid_positions(16, 128)
    assert table.shape == (16, 128)
    assert torch.equal(table[0, :32], torch.zeros(32)) and torch.equal(table[0, 32:64],
                                                                        torch.ones(32))
    rows_first = table[:, :64].reshape(4, 4, 64)  # the first half varies with the row only
    assert torch.equal(rows_first[:, 0], rows_first[:, 3])
    assert not torch.equal(rows_first[0, 0], rows_first[1, 0])
    assert torch.equal(initial_value("vision.pos_embed.weight", (16, 128), seed=1, std=0.02,
                                     num_layers=2), table)
    patch = initial_value("vision.patch_embed.weight", (128, 3, 8, 8), seed=1, std=0.02,
                          num_layers=2)
    assert abs(float(patch.std()) - 1 / 192 ** 0.5) < 0.005
