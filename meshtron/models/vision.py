"""The vision encoder of a vision-language-action policy (OpenVLA / PaliGemma style).

SigLIP's vision tower (``transformers``' ``SiglipVisionModel`` without its pooling head): a
patch embedding, learned positions, pre-norm blocks of bidirectional multi-head attention and
a GELU (tanh) MLP, a final LayerNorm; then OpenVLA's projector, Linear -> GELU -> Linear, into
the decoder's width, and a keypoint readout token that says where things are (the token the
policy reads the motion from; :class:`KeypointReadout`). It is written on the same
tensor-parallel layers as the decoder, so tp splits its heads and MLP units (and the
projector's hidden units) exactly as there, and initialisation, checkpoints and the grad norm
read its parameters' layouts like any other.

The encoder never uses sequence parallelism: its tokens are few, every tp rank holds all of
them, and its output (replicated over tp) enters the decoder, which scatters it under SP.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import VisionConfig
from meshtron.errors import MeshtronError
from meshtron.models.input_encoder import InputEncoder
from meshtron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRegion,
    replicated,
)


def check_buildable(vision: VisionConfig, decoder_hidden: int, tp: int) -> None:
    """One line on the first setting the encoder cannot be built with (a VisionConfig built
    in code, such as an imported tower's, has not been through the config's checks)."""
    if not vision.enabled:
        raise MeshtronError("model.vision.image_size is 0: the model has no vision encoder")
    if vision.image_size % vision.patch_size:
        raise MeshtronError(f"model.vision.image_size={vision.image_size} is not a multiple of "
                            f"model.vision.patch_size={vision.patch_size}")
    if vision.hidden_size % vision.num_heads:
        raise MeshtronError(f"model.vision.hidden_size={vision.hidden_size} is not divisible by "
                            f"model.vision.num_heads={vision.num_heads}")
    for what, n in (("model.vision.num_heads", vision.num_heads),
                    ("model.vision.ffn_hidden_size", vision.ffn_hidden_size),
                    ("model.hidden_size", decoder_hidden)):
        if n % tp:
            raise MeshtronError(f"{what}={n} is not divisible by parallel.tp={tp}")


def _layer_norm(width: int, eps: float, region: TPRegion) -> nn.LayerNorm:
    norm = nn.LayerNorm(width, eps=eps)
    for param in norm.parameters():
        replicated(param, region)
    return norm


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention with biases; heads split over tp (fused column-
    parallel [q | k | v], row-parallel output projection)."""

    def __init__(self, vision: VisionConfig, region: TPRegion):
        super().__init__()
        h = vision.hidden_size
        self.region = region
        self.head_dim = h // vision.num_heads
        self.num_heads = vision.num_heads // region.size
        self.qkv = ColumnParallelLinear(h, 3 * h, True, region, parts=3)
        self.proj = RowParallelLinear(h, h, True, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.region.enter(x)
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class VisionMLP(nn.Module):
    """up -> gelu (tanh approximation, SigLIP's ``gelu_pytorch_tanh``) -> down, with biases,
    split over tp by hidden units."""

    def __init__(self, vision: VisionConfig, region: TPRegion):
        super().__init__()
        self.region = region
        self.up = ColumnParallelLinear(vision.hidden_size, vision.ffn_hidden_size, True, region)
        self.down = RowParallelLinear(vision.ffn_hidden_size, vision.hidden_size, True, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.region.enter(x)), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionConfig, region: TPRegion):
        super().__init__()
        self.attn_norm = _layer_norm(vision.hidden_size, vision.norm_eps, region)
        self.attn = VisionAttention(vision, region)
        self.mlp_norm = _layer_norm(vision.hidden_size, vision.norm_eps, region)
        self.mlp = VisionMLP(vision, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Projector(nn.Module):
    """OpenVLA's ``gelu-mlp`` projector: Linear(vision -> decoder) -> GELU -> Linear(decoder ->
    decoder), column- then row-parallel."""

    def __init__(self, vision_hidden: int, decoder_hidden: int, region: TPRegion):
        super().__init__()
        self.region = region
        self.fc1 = ColumnParallelLinear(vision_hidden, decoder_hidden, True, region)
        self.fc2 = RowParallelLinear(decoder_hidden, decoder_hidden, True, region)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.region.enter(x))))


class KeypointReadout(nn.Module):
    """One token that says where things are: softmax maps over the patches (spatial softmax,
    as visuomotor policies since Levine et al. 2016 read images), each map's expected (x, y)
    on the patch grid in [-1, 1], through Linear -> GELU -> Linear into the decoder's width,
    then an RMSNorm so that the token starts at the residual stream's scale (at the
    projector's scale the decoder never read it). ``keypoints`` maps are fixed (one logit per
    patch state); ``instruction_keypoints`` maps are queried by the instruction (the mean of
    its words' embeddings, a table of the readout's own), so they can point at the block the
    instruction names (RT-1 conditions its image encoder on the instruction likewise, by
    FiLM). Small, so replicated over tp."""

    def __init__(self, vision: VisionConfig, decoder_hidden: int, vocab_size: int,
                 region: TPRegion):
        super().__init__()
        h, k, m, d = vision.hidden_size, vision.keypoints, vision.instruction_keypoints, \
            decoder_hidden
        self.hidden, self.queried = h, m
        self.attend = nn.Linear(h, k) if k else None
        if m:
            self.words = nn.Embedding(vocab_size, h)
            self.query = nn.Linear(h, m * h)
        self.fc1 = nn.Linear(2 * (k + m), d)
        self.fc2 = nn.Linear(d, d)
        self.out_norm = nn.RMSNorm(d, eps=vision.norm_eps)
        for param in self.parameters():
            replicated(param, region)
        side = math.isqrt(vision.num_patches)
        axis = torch.linspace(-1.0, 1.0, side)
        rows, cols = torch.meshgrid(axis, axis, indexing="ij")
        self.register_buffer("grid", torch.stack([cols.reshape(-1), rows.reshape(-1)], dim=1),
                             persistent=False)  # [patches, 2]: (x, y) of each patch centre

    def forward(self, hidden: torch.Tensor,
                instruction: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder states [b, patches, vision hidden] and instruction ids [b, instruction_len]
        (pad id 0; None: no words) -> the readout token [b, 1, decoder hidden]."""
        logits = [] if self.attend is None else [self.attend(hidden).transpose(1, 2)]
        if self.queried:
            words = torch.zeros_like(hidden[:, 0])
            if instruction is not None:
                real = (instruction > 0).to(hidden.dtype)[..., None]
                words = (self.words(instruction) * real).sum(1) / real.sum(1).clamp(min=1)
            query = self.query(words).view(-1, self.queried, self.hidden)
            logits.append(query @ hidden.transpose(1, 2) / math.sqrt(self.hidden))
        maps = torch.softmax(torch.cat(logits, dim=1).float(), dim=-1)  # [b, maps, patches]
        points = (maps @ self.grid.to(maps.dtype)).to(hidden.dtype).flatten(1)
        return self.out_norm(self.fc2(F.gelu(self.fc1(points))))[:, None]


class VisionEncoder(InputEncoder):
    """Camera images -> image tokens in the decoder's width, replicated on every tp rank; as
    the decoder's input encoder ``vision`` (:class:`InputEncoder`), the patch tokens take the
    window's first positions and the readout token, queried by the instruction's ids, the
    position right before the actions (``vision.image_token_positions``).

    ``region`` is the decoder's tp region; its sequence parallelism is dropped (see the module
    docstring). Parameters, as the decoder's submodule ``vision``: ``patch_embed.weight``
    [hidden, channels, patch, patch] (a Conv2d's, as in SigLIP) and ``.bias``,
    ``pos_embed.weight``, ``layers.{i}.{attn_norm,mlp_norm}.{weight,bias}``,
    ``layers.{i}.attn.{qkv,proj}.{weight,bias}``, ``layers.{i}.mlp.{up,down}.{weight,bias}``,
    ``post_norm.{weight,bias}``, ``projector.{fc1,fc2}.{weight,bias}`` and, with
    a readout token, ``readout.{attend,fc1,fc2}.{weight,bias}``, ``readout.out_norm.weight``
    and, with instruction keypoints, ``readout.words.weight``, ``readout.query.{weight,bias}``.
    """

    def __init__(self, vision: VisionConfig, decoder_hidden: int, region: TPRegion,
                 vocab_size: int = 0):
        super().__init__()
        check_buildable(vision, decoder_hidden, region.size)
        region = TPRegion(region.group)  # never sequence-parallel
        self.vision = vision
        self.pretrained = vision.pretrained
        h, p = vision.hidden_size, vision.patch_size
        self.patch_embed = nn.Conv2d(vision.channels, h, p, stride=p)
        self.pos_embed = nn.Embedding(vision.num_patches, h)
        for param in (*self.patch_embed.parameters(), self.pos_embed.weight):
            replicated(param, region)
        self.layers = nn.ModuleList(VisionBlock(vision, region) for _ in range(vision.num_layers))
        self.post_norm = _layer_norm(h, vision.norm_eps, region)
        self.projector = Projector(h, decoder_hidden, region)
        self.readout = (KeypointReadout(vision, decoder_hidden, vocab_size, region)
                        if vision.readout_tokens else None)

    def forward(self, images: torch.Tensor,
                instruction: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 images [b, H, W, C] (as a camera gives them) -> the image tokens [b,
        num_patches + readout_tokens, decoder_hidden] in the parameters' dtype (for the
        window positions ``vision.image_token_positions``); normalised as SigLIP's processor
        does. ``instruction`` (ids [b, instruction_len]) queries the readout's instruction
        keypoints."""
        v = self.vision
        if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != (
                v.image_size, v.image_size, v.channels):
            raise MeshtronError(
                f"images must be uint8 [batch, {v.image_size}, {v.image_size}, {v.channels}], "
                f"got {images.dtype} {list(images.shape)}")
        pixels = (images.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
        hidden = self.encode(pixels)
        tokens = self.project(hidden)
        if self.readout is None:
            return tokens
        readout = self.readout(hidden, instruction).to(tokens.dtype)
        return torch.cat([tokens, readout], dim=1)

    def positions(self) -> list[int]:
        return self.vision.image_token_positions

    def encode_input(self, value: torch.Tensor, tokens: torch.Tensor,
                     start: int) -> torch.Tensor:
        """The image tokens of images ``value`` for the window positions ``start..`` of
        ``tokens``, whose instruction (right after the patches) queries the readout token."""
        v = self.vision
        first = v.num_patches - start
        if v.instruction_keypoints and not 0 <= first <= tokens.shape[1] - v.instruction_len:
            raise MeshtronError("the readout token's instruction keypoints need the "
                                "instruction in the same forward call as the image")
        instruction = tokens[:, first:first + v.instruction_len] if first >= 0 else None
        return self(value, instruction)

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Float pixels [b, C, H, W] (HF's layout) -> the last hidden state after the final
        LayerNorm, [b, num_patches, vision hidden] (HF's ``last_hidden_state``)."""
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x.flatten(2).transpose(1, 2) + self.pos_embed.weight
        for layer in self.layers:
            x = layer(x)
        return self.post_norm(x)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Encoder states [b, n, vision hidden] -> image tokens [b, n, decoder hidden]."""
        return self.projector(hidden)


def vision_parameters(vision: VisionConfig, decoder_hidden: int, vocab_size: int = 0) -> int:
    """Parameters of the encoder, projector and readout token (global: each counted once;
    ``vocab_size``: the rows of the readout's word table)."""
    h, f, d = vision.hidden_size, vision.ffn_hidden_size, decoder_hidden
    patch = vision.channels * vision.patch_size ** 2
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (2 * h * f + f + h)
    readout = 0
    if vision.readout_tokens:
        k, m = vision.keypoints, vision.instruction_keypoints
        readout = ((h * k + k if k else 0) + (vocab_size * h + h * m * h + m * h if m else 0)
                   + (2 * (k + m) * d + d) + (d * d + d) + d)
    return (patch * h + h + vision.num_patches * h + vision.num_layers * block + 2 * h
            + (h * d + d) + (d * d + d) + readout)


def vision_flops(vision: VisionConfig, decoder_hidden: int) -> int:
    """Forward FLOPs for one image: 2 x the multiply-adds of every matrix product (patch
    embedding, q/k/v, scores, values, output projection, MLP, projector; the readout's
    keypoint logits, instruction queries and their scores, expected positions and MLP)."""
    h, f, d, n = vision.hidden_size, vision.ffn_hidden_size, decoder_hidden, vision.num_patches
    patch = vision.channels * vision.patch_size ** 2
    block = 4 * h * h + 2 * n * h + 2 * h * f
    readout = 0
    if vision.readout_tokens:
        k, m = vision.keypoints, vision.instruction_keypoints
        readout = (n * h * k + h * m * h + m * n * h + 2 * (k + m) * n + 2 * (k + m) * d
                   + d * d)
    return 2 * (n * (patch * h + vision.num_layers * block + h * d + d * d) + readout)
