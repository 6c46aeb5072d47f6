"""The ``data`` section: where the training text comes from, how it is tokenised, and how
conversations (``data.format=chat``) become training windows (``data.chat``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtron.errors import MeshtronError

DATA_FORMATS = ("auto", "text", "chat")
LONG_RECORDS = ("refuse", "truncate")


@dataclass
class ChatConfig:
    """Conversations as training data (``data.chat.*``, used when ``data.format`` is chat)."""

    include_prompt: bool = False
    """Count the loss on every token of a conversation, not only the assistant's answers."""
    long_records: str = "refuse"
    """A conversation longer than train.seq_len + 1 tokens: refuse (its file and line said) or
    truncate (its first seq_len + 1 tokens kept)."""
    template: str | None = None
    """A .jinja chat template used instead of the tokenizer's own (None: the one beside
    data.tokenizer, in chat_template.jinja or tokenizer_config.json)."""


@dataclass
class DataConfig:
    """Where the training text comes from and how it is tokenised."""

    path: list[str] | None = None
    """Raw text (.txt, folder, .jsonl) or indexed-dataset prefixes; 'w:path' entries blend."""
    cache_dir: str = "~/.cache/meshtron"
    """Where tokenizers and preprocessed datasets are cached."""
    tokenizer: str | None = None
    """A tokenizer.json to use; None trains a byte-level BPE on the training text."""
    vocab_size: int = 8192
    """Vocabulary size of a tokenizer trained here."""
    valid_fraction: float = 0.02
    """Share of each dataset's tokens held out for validation (its tail, whole windows, >= 1)."""
    corpus_max_mb: float = 8.0
    """Size cap of the embedded default corpus (the standard library's sources)."""
    document_mask: bool = False
    """Attention stays inside each document of a packed sequence (documents end with EOS)."""
    reset_positions: bool = False
    """Positions restart at every document (with document_mask)."""
    format: str = "auto"
    """text, chat (JSONL of {"messages": [{"role", "content"}, ...]}, rendered with the
    tokenizer's chat template, loss on the answers) or auto (chat when every path is such JSONL)."""
    chat: ChatConfig = field(default_factory=ChatConfig)
    """Conversations as training data (data.chat.*)."""


def check_data_section(d: DataConfig) -> None:
    """The data section's choices on their own."""
    for name, value, choices in (("data.format", d.format, DATA_FORMATS),
                                 ("data.chat.long_records", d.chat.long_records, LONG_RECORDS)):
        if value not in choices:
            raise MeshtronError(f"{name}='{value}' is not one of {', '.join(choices)}")
