"""The training data of a run and the format of its batch rows, chosen by the model's kind.

Every kind of model (:mod:`meshtron.config.kinds`) has one builder here: token windows from
text for a language model, observation windows from demonstrations for a vision-language-action
policy; and one row format: none for text (a row is a window), the window then the image's
pixels for a policy. The trainer asks for the run's data and gets an object of one interface
(:class:`RunData`) whatever the kind, and the rank's sequence split asks for the row format;
a new modality is a new entry in each registry, not a new branch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from meshtron.config import Config, ModelConfig
from meshtron.config.kinds import TEXT, VLA, model_kind
from meshtron.data.chat import build_chat_data, uses_chat
from meshtron.data.tokenizer import Log, Tokenizer
from meshtron.data.training_data import build_training_data
from meshtron.data.vla_data import ObservationRows, build_policy_data


class RunData(Protocol):
    """What the trainer reads from its data, whatever the model's kind."""

    tokenizer: Tokenizer

    def train_batch(self, k: int, global_batch: int) -> torch.Tensor:
        """Global batch ``k`` as rows, a function of (seed, k) only."""
        ...

    def valid_batch(self, k: int, batch: int) -> torch.Tensor:
        """Validation batch ``k`` as rows."""
        ...

    def resolved(self, cfg: Config) -> Config:
        """``cfg`` with what the data settles of the model (a policy's action range)."""
        ...


def _text_data(cfg: Config, log: Log) -> RunData:
    if uses_chat(cfg.data):  # conversations: rendered with the model's template, answers' loss
        return build_chat_data(cfg, log)
    return build_training_data(cfg.data, cfg.train.seq_len, cfg.train.seed, log)


def _policy_data(cfg: Config, log: Log) -> RunData:
    return build_policy_data(cfg, log)


DATA_BUILDERS: dict[str, Callable[[Config, Log], RunData]] = {
    TEXT: _text_data,
    VLA: _policy_data,
}
"""Per model kind, the builder of its training data from the run's config."""


def build_run_data(cfg: Config, log: Log = print) -> RunData:
    """The training and validation data of ``cfg``'s run, by its model's kind."""
    return DATA_BUILDERS[model_kind(cfg.model).name](cfg, log)


ROW_FORMATS: dict[str, Callable[[ModelConfig], Any]] = {
    TEXT: lambda model: None,
    VLA: lambda model: ObservationRows(model.vision.image_shape, model.vision.state_dims),
}
"""Per model kind, how its batch rows carry more than a token window (None: they do not)."""


def row_format(model: ModelConfig) -> Any:
    """The :class:`~meshtron.parallel.context.sequence.RowFormat` of the batch rows of a model
    of ``model`` (what its sequence split unpacks), or None when rows are token windows."""
    return ROW_FORMATS[model_kind(model).name](model)
