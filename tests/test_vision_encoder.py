"""The VLA vision encoder: HF SigLIP import parity, tp=2 parity, its size and FLOP formulas,
the refusals of bad folders, and the uint8 camera path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from meshtron.checkpoint.hf_vision import load_hf_vision, vision_config_from_hf
from meshtron.config import VisionConfig, load_config
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize
from meshtron.models.vision import VisionEncoder, vision_flops, vision_parameters
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.mesh.groups import CommStats, Group
from meshtron.parallel.mesh.params import layout_of
from meshtron.parallel.tensor.layers import TPRegion
from tests.distributed import run_distributed

TOWER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             image_size=32, patch_size=8)
DECODER_HIDDEN = 96
TOL = 1e-5


def _perturb(model: nn.Module) -> None:
    """Random norms and biases too (HF starts them at ones and zeros)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _pixels() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def siglip(tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A tiny SigLIP vision tower saved as save_pretrained writes it, some pixels and its
    last hidden state for them."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    folder = tmp_path_factory.mktemp("siglip")
    model = SiglipVisionModel(SiglipVisionConfig(**TOWER)).eval()
    _perturb(model)
    model.save_pretrained(folder)
    with torch.no_grad():
        hidden = model(pixel_values=_pixels()).last_hidden_state
    return folder, _pixels(), hidden


def _single() -> TPRegion:
    return TPRegion(ParallelMesh.single().tp)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _wrapped(vision: VisionConfig, region: TPRegion) -> nn.Module:
    """The encoder as the decoder's submodule ``vision`` (global names ``vision.*``),
    initialised from the seed and those names."""
    root = nn.Module()
    root.vision = VisionEncoder(vision, DECODER_HIDDEN, region)
    initialize(root, seed=7, std=0.2, num_layers=2)
    return root


def _imported(folder: Path, region: TPRegion) -> VisionEncoder:
    """Initialised (the projector keeps its initial values), then the tower imported."""
    encoder = _wrapped(vision_config_from_hf(folder), region).vision
    load_hf_vision(folder, encoder)
    return encoder


def test_siglip_import_matches_hf(siglip):
    folder, pixels, hidden = siglip
    vision = vision_config_from_hf(folder)
    assert (vision.image_size, vision.patch_size, vision.channels, vision.hidden_size,
            vision.num_layers, vision.num_heads, vision.ffn_hidden_size, vision.norm_eps) == (
                32, 8, 3, 64, 2, 4, 128, 1e-6)
    with torch.no_grad():
        out = _imported(folder, _single()).encode(pixels)
    assert out.shape == hidden.shape == (2, 16, 64)
    assert (out - hidden).abs().max().item() <= TOL and _rel(out, hidden) <= TOL


def test_full_siglip_model_folder(tmp_path):
    from transformers import SiglipConfig, SiglipModel

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, vocab_size=64, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
    model = SiglipModel(SiglipConfig(text_config=text, vision_config=TOWER)).eval()
    _perturb(model)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        hidden = model.vision_model(pixel_values=_pixels()).last_hidden_state
        out = _imported(tmp_path, _single()).encode(_pixels())
    assert _rel(out, hidden) <= TOL


# ----------------------------------------------------------------------------- tp = 2


def _tp_checks(rank: int, world_size: int, folder: str, hidden: torch.Tensor) -> dict:
    vision = vision_config_from_hf(Path(folder))
    mesh = ParallelMesh(MeshLayout(world_size, tp=world_size), rank)
    gen = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8, generator=gen)
    probe = torch.randn(2, 16, DECODER_HIDDEN, generator=gen)
    results = {}
    ref, par = _wrapped(vision, _single()), _wrapped(vision, TPRegion(mesh.tp))
    sp = _wrapped(vision, TPRegion(mesh.tp, sequence_parallel=True))  # SP is dropped
    outs = []
    for model in (ref, par):
        out = model.vision(images)
        (out * probe).sum().backward()
        outs.append(out.detach())
    results["output"] = _rel(outs[1], outs[0])
    with torch.no_grad():
        results["output_sp"] = _rel(sp.vision(images), outs[0])
    grads, split = [], 0
    ref_params = dict(ref.named_parameters())
    for name, param in par.named_parameters():
        layout, full = layout_of(param), ref_params[name]
        assert tuple(layout.global_shape) == tuple(full.shape), name
        split += layout.tp_slice is not None
        expected = layout.tp_slice.take(full.grad) if layout.tp_slice is not None else full.grad
        grads.append(_rel(param.grad, expected))
    results["grad"], results["split_params"] = max(grads), split
    with torch.no_grad():
        results["import"] = _rel(_imported(Path(folder), TPRegion(mesh.tp)).encode(_pixels()),
                                 hidden)
    return results


def test_tensor_parallel_matches_one_process(siglip):
    folder, _, hidden = siglip
    for result in run_distributed(_tp_checks, 2, str(folder), hidden, timeout=120):
        # qkv, proj, up, down: weight + bias (proj/down bias replicated) x 2 layers, projector
        assert result["split_params"] == 2 * 6 + 3
        for key in ("output", "output_sp", "grad", "import"):
            assert result[key] <= TOL, (key, result[key])


# ----------------------------------------------------------------------------- sizes


def _vision(**overrides) -> VisionConfig:
    args = [f"--model.vision.{k}={v}" for k, v in {"image_size": 32, **overrides}.items()]
    return load_config(None, args).model.vision


@pytest.mark.parametrize("overrides", [{}, dict(patch_size=4, hidden_size=48, num_layers=3,
                                                 num_heads=3, ffn_hidden_size=80, channels=1,
                                                 keypoints=0)])
def test_flops_and_parameters_match_the_module(overrides):
    vision = _vision(**overrides)
    encoder = _wrapped(vision, _single()).vision
    assert vision_parameters(vision, DECODER_HIDDEN) == sum(p.numel()
                                                            for p in encoder.parameters())
    images = torch.zeros(1, 32, 32, vision.channels, dtype=torch.uint8)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        encoder(images)
    # the counter sees the convolution and the linear layers, not CPU attention kernels
    n, h = vision.num_patches, vision.hidden_size
    attention = vision.num_layers * 2 * (2 * n * n * h)
    assert vision_flops(vision, DECODER_HIDDEN) == counter.get_total_flops() + attention


def test_formulas_by_hand():
    vision = _vision(hidden_size=64, ffn_hidden_size=128, keypoints=0,
                     instruction_keypoints=0)  # 16 8x8x3 patches
    block = 2 * 64 + 64 * 192 + 192 + 64 * 64 + 64 + 2 * 64 + 64 * 128 + 128 + 128 * 64 + 64
    params = 192 * 64 + 64 + 16 * 64 + 2 * block + 2 * 64 + 64 * 96 + 96 + 96 * 96 + 96
    assert vision_parameters(vision, 96) == params == 96000
    macs = 16 * (192 * 64 + 2 * (64 * 192 + 16 * 64 * 2 + 64 * 64 + 2 * 64 * 128)
                 + 64 * 96 + 96 * 96)
    assert vision_flops(vision, 96) == 2 * macs
    # the readout token: 8 keypoint maps over 16 patches, their (x, y) into a 96-wide MLP
    readout = _vision(hidden_size=64, ffn_hidden_size=128, keypoints=8, instruction_keypoints=0)
    assert vision_parameters(readout, 96) - params == (64 * 8 + 8) + (16 * 96 + 96) + (
        96 * 96 + 96) + 96
    assert vision_flops(readout, 96) - 2 * macs == 2 * (16 * 64 * 8 + 2 * 8 * 16 + 16 * 96
                                                         + 96 * 96)
    # + 2 maps queried by the instruction: a 20-word table, a query per map, its 16 scores
    asked = _vision(hidden_size=64, ffn_hidden_size=128, keypoints=8, instruction_keypoints=2)
    assert vision_parameters(asked, 96, vocab_size=20) - vision_parameters(readout, 96) == (
        20 * 64 + 64 * 2 * 64 + 2 * 64 + 2 * 2 * 96)
    assert vision_flops(asked, 96) - vision_flops(readout, 96) == 2 * (
        64 * 2 * 64 + 2 * 16 * 64 + 2 * 2 * 16 + 2 * 2 * 96)


# ----------------------------------------------------------------------------- refusals


def _edited(src: Path, dst: Path, config: dict | None = None, drop: str | None = None,
            reshape: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}))
    if drop or reshape:
        tensors = load_file(dst / "model.safetensors")
        tensors.pop(drop, None)
        if reshape:
            tensors[reshape] = tensors[reshape][:-1]
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _config_only(dst: Path, config: dict) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _refused(folder: Path, match: str, vision: VisionConfig | None = None) -> None:
    with pytest.raises(MeshtronError, match=match) as err:
        vision = vision or vision_config_from_hf(folder)
        load_hf_vision(folder, VisionEncoder(vision, DECODER_HIDDEN, _single()))
    assert "\n" not in str(err.value)


def test_bad_folders_are_refused_in_one_line(siglip, tmp_path):
    src = siglip[0]
    good = vision_config_from_hf(src)
    _refused(tmp_path / "nowhere", "vision model folder not found")
    _refused(_config_only(tmp_path / "llama", {"model_type": "llama", "hidden_size": 64}),
             "model_type 'llama' is not a vision tower")
    _refused(_config_only(tmp_path / "vit", {"model_type": "vit"}), "ViT is not supported")
    _refused(_config_only(tmp_path / "naflex", {"model_type": "siglip2_vision_model"}),
             "SigLIP2 .* NaFlex")
    _refused(_edited(src, tmp_path / "gelu", {"hidden_act": "gelu"}),
             "hidden_act 'gelu' is not supported")
    _refused(_edited(src, tmp_path / "odd", {"patch_size": 5}), "not a multiple of patch_size")
    _refused(_edited(src, tmp_path / "missing", drop="encoder.layers.1.self_attn.k_proj.weight"),
             "lacks tensor 'encoder.layers.1.self_attn.k_proj.weight'")
    _refused(_edited(src, tmp_path / "shape", reshape="embeddings.position_embedding.weight"),
             r"'embeddings.position_embedding.weight' .* has shape \[15, 64\], .* \[16, 64\]")
    wider = VisionConfig(**{**good.__dict__, "ffn_hidden_size": 256})
    _refused(src, "ffn_hidden_size=128, the encoder was built with "
             "model.vision.ffn_hidden_size=256", wider)
    with pytest.raises(MeshtronError, match="not divisible by parallel.tp=3"):
        VisionEncoder(good, DECODER_HIDDEN, TPRegion(Group("tp", [0, 1, 2], 0, None, CommStats())))
    with pytest.raises(MeshtronError, match="images must be uint8"):
        VisionEncoder(good, DECODER_HIDDEN, _single())(torch.zeros(1, 32, 32, 3))


# ----------------------------------------------------------------------------- uint8 images


def test_uint8_images_are_normalised_as_siglip_does(siglip):
    encoder = _imported(siglip[0], _single())
    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(4))
    pixels = (images.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    try:  # the processor itself, where its PIL backend imports
        from transformers.models.siglip.image_processing_pil_siglip import (
            SiglipImageProcessorPil,
        )

        processed = SiglipImageProcessorPil(do_resize=False)(
            images=list(images.numpy()), return_tensors="pt")["pixel_values"]
        assert torch.allclose(processed, pixels, atol=1e-6)
    except ImportError:
        pass
    with torch.no_grad():
        out = encoder(images)
        expected = encoder.project(encoder.encode(pixels))
    assert out.shape == (2, 16, DECODER_HIDDEN) and out.dtype == torch.float32
    assert torch.equal(out, expected)
