"""The seam between the decoder and what it reads besides tokens: input encoders.

An input encoder turns one named entry of the model's extra inputs (a camera frame, say) into
tokens in the decoder's width and says which window positions they take; the decoder embeds
its token ids as always and then lets each encoder it holds overwrite its positions
(:func:`place_encoded`). The decoder, the pipeline executor and the sequence split never look
inside the inputs: they carry a mapping from encoder name to tensor, opaque to them, from the
batch to the encoder. Which encoders a model holds is chosen by its kind
(:mod:`meshtron.models.modalities`).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import torch
from torch import nn

from meshtron.errors import MeshtronError
from meshtron.parallel.tensor.collectives import local_chunk, split_to_tp
from meshtron.parallel.tensor.layers import TPRegion

ModelInputs = Mapping[str, torch.Tensor]
"""The model's inputs besides token ids, by the name of the input encoder that reads each."""


class InputEncoder(nn.Module, abc.ABC):
    """One modality's encoder, held by the decoder's first stage under its input's name.

    Subclasses say where their tokens go (:meth:`positions`) and make them (:meth:`encode_input`);
    the placement itself, the same for every modality, is :func:`place_encoded`'s."""

    pretrained: str | None = None
    """A folder of released weights the encoder starts from (loaded by
    :mod:`meshtron.checkpoint.encoder_weights` after initialisation); None: drawn from the seed."""

    @abc.abstractmethod
    def positions(self) -> list[int]:
        """The window positions its tokens take, in the order :meth:`encode_input` returns them."""

    @abc.abstractmethod
    def encode_input(self, value: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Its tokens [b, len(positions()), decoder hidden] for input ``value``; ``tokens``:
        the ids of the window positions ``start..`` being embedded (whole under sequence
        parallelism), for an encoder that reads some of them."""


def place_encoded(encoder: InputEncoder, x: torch.Tensor, value: torch.Tensor, start: int,
                  tokens: torch.Tensor, region: TPRegion) -> torch.Tensor:
    """Token embeddings ``x`` of positions ``start..`` with those at ``encoder``'s positions
    replaced by its tokens; under sequence parallelism each rank replaces its own chunk's (the
    split's backward gathers their gradients). A window past all its positions runs no
    encoder."""
    full = x.shape[1] * (region.size if region.sequence_parallel else 1)
    slot = torch.full((full,), -1, dtype=torch.long)
    for j, position in enumerate(encoder.positions()):
        if start <= position < start + full:
            slot[position - start] = j
    if bool((slot < 0).all()):
        return x
    encoded = encoder.encode_input(value, tokens, start).to(x.dtype)
    slot = slot.to(x.device)
    placed, keep = encoded[:, slot.clamp(min=0)], slot >= 0
    if region.sequence_parallel:
        placed = split_to_tp(placed, region.group)
        keep = local_chunk(keep, region.group, dim=0)
    return torch.where(keep[None, :, None], placed, x)


def place_inputs(encoders: Mapping[str, InputEncoder], x: torch.Tensor,
                 inputs: ModelInputs | None, start: int, tokens: torch.Tensor,
                 region: TPRegion) -> torch.Tensor:
    """``x`` with every encoder's tokens placed whose input is in ``inputs`` (an input left
    out, as in a cached decoding step past the prefix, leaves its positions as embedded); a
    name no encoder reads is refused (it would be dropped without a word)."""
    unknown = sorted(set(inputs or ()) - set(encoders))
    if unknown:
        raise MeshtronError(f"the model has no input encoder for {', '.join(unknown)} (its "
                            f"encoders: {', '.join(encoders) or 'none'})")
    for name, encoder in encoders.items():
        if inputs is not None and name in inputs:
            x = place_encoded(encoder, x, inputs[name], start, tokens, region)
    return x
