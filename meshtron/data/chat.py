"""Conversations as training data (``data.format=chat``): JSONL records of ``messages``
rendered with the model's own chat template, a loss weight on every token, packed into windows.

**Tokens.** A record's text is its conversation rendered by the tokenizer's chat template
(:mod:`meshtron.data.chat_template`) and its tokens are that text encoded without added special
tokens, exactly what ``transformers``' ``apply_chat_template(..., tokenize=True)`` gives. The
tokenizer's end-of-text token (meshtron's document separator) follows each record unless the
rendering ends with it already.

**Which tokens carry loss.** The assistant's answers, found by rendering prefixes: for the
assistant message i, the text of messages ``[:i]`` with the generation prompt ends where its
answer starts, and the text of messages ``[:i+1]`` (trailing whitespace dropped) ends where
its turn ends, so the answer's content and its end-of-turn token (``<|im_end|>``,
``<|eot_id|>``, ...) count and the role header, the prompt and the system text do not. A token
counts when its first character lies inside an answer. This needs no markup in the template
(``{% generation %}`` is not required) but it needs templates that render a conversation the
same way whatever follows (a record where a prefix renders differently is refused).
``data.chat.include_prompt`` counts every token instead. A record's first token never counts
(it would be predicted from the record before it).

**Weights in windows.** A token whose loss does not count is stored as ``-(id + 1)``: "read,
never predicted", the convention :class:`~meshtron.parallel.context.sequence.SequenceSplit`
already undoes (the model reads the id, the target becomes -1, which the loss skips). Rows stay
plain token windows, so they split over dp, micro-batches, cp and pipeline stages unchanged.

**Packing.** Records are packed whole, in file order, into windows of ``seq_len + 1`` tokens
(the next record that does not fit starts a new window; the rest is end-of-text padding that
carries no loss), so a record never straddles two windows and no answer's loss is cut at a
window boundary. Each record is its own document (``data.document_mask`` is turned on: records
never attend to each other). A record longer than a window is refused, or truncated with
``data.chat.long_records=truncate``. The last ``data.valid_fraction`` of the windows (at least
one) is held out for validation. Global batch k is a function of (seed, k) as for text.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer

from meshtron.config import Config, DataConfig
from meshtron.data.blend import parse_blend
from meshtron.data.chat_template import ChatTemplate, TemplateFailed, find_chat_template
from meshtron.data.sampler import GlobalSampler
from meshtron.data.tokenizer import Log, Tokenizer
from meshtron.errors import MeshtronError

ROLES = ("system", "user", "assistant")
"""The roles a message may have."""


def is_chat_jsonl(path: str) -> bool:
    """Whether ``path`` is a JSONL file whose first record holds ``messages`` (how
    ``data.format=auto`` tells conversations from JSONL text)."""
    location = Path(path).expanduser()
    if location.suffix != ".jsonl" or not location.is_file():
        return False
    try:
        with location.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    return isinstance(record, dict) and "messages" in record
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def uses_chat(data: DataConfig) -> bool:
    """Whether the run's data is conversations: ``data.format=chat``, or ``auto`` with every
    path chat JSONL."""
    if data.format != "auto":
        return data.format == "chat"
    return bool(data.path) and all(is_chat_jsonl(path) for _, path in parse_blend(data.path))


def read_records(path: Path) -> list[tuple[int, list[dict[str, str]]]]:
    """(line number, messages) of every non-blank line of ``path``, each checked: JSON, an
    object with a list of messages, known roles, string contents, an assistant turn."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise MeshtronError(f"cannot read chat data {path} ({err})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append((number, check_record(line, f"{path}:{number}")))
    if not records:
        raise MeshtronError(f"{path} holds no conversations")
    return records


def check_record(line: str, where: str) -> list[dict[str, str]]:
    """The messages of one JSONL line, or one line saying what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise MeshtronError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise MeshtronError(f'{where}: a record needs "messages", a non-empty list of '
                            '{"role", "content"} objects')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise MeshtronError(f'{where}: message {i} needs a "role" and a string "content"')
        if message.get("role") not in ROLES:
            raise MeshtronError(f"{where}: message {i} has the unknown role "
                                f"{message.get('role')!r} (known: {', '.join(ROLES)})")
    if not any(m["role"] == "assistant" for m in messages):
        raise MeshtronError(f"{where}: the conversation has no assistant turn, so nothing to "
                            "learn from")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass
class ChatEncoder:
    """Conversations -> token ids and loss weights, with one tokenizer and its template."""

    tokenizer: Tokenizer
    template: ChatTemplate
    include_prompt: bool = False
    _offsets: HFTokenizer = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The same tokenizer.json, for character offsets (meshtron's Tokenizer gives ids only).
        self._offsets = HFTokenizer.from_file(str(self.tokenizer.path))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               where: str) -> str:
        try:
            return self.template.render(messages, add_generation_prompt)
        except TemplateFailed as err:
            raise MeshtronError(f"{where}: the chat template ({self.template.where}) failed to "
                                f"render it: {err}") from None

    def answer_spans(self, messages: list[dict[str, Any]], text: str,
                     where: str) -> list[tuple[int, int]]:
        """Character spans of ``text`` (the whole conversation) holding each assistant turn."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self.render(messages[:i], True, where)
            end = self.render(messages[: i + 1], False, where).rstrip()
            if not (text.startswith(start) and text.startswith(end) and len(end) > len(start)):
                raise MeshtronError(
                    f"{where}: the chat template ({self.template.where}) renders message {i}'s "
                    "conversation differently when later messages follow, so its answer "
                    "cannot be located; set data.chat.include_prompt=true or use another template")
            spans.append((len(start), len(end)))
        return spans

    def encode(self, messages: list[dict[str, Any]], where: str) -> np.ndarray:
        """The record's tokens, those without loss stored as ``-(id + 1)``, end-of-text last."""
        text = self.render(messages, False, where)
        encoding = self._offsets.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        if self.include_prompt:
            weighted = np.ones(len(ids), dtype=bool)
        else:
            starts = np.asarray([a for a, _ in encoding.offsets], dtype=np.int64)
            weighted = np.zeros(len(ids), dtype=bool)
            for a, b in self.answer_spans(messages, text, where):
                weighted |= (starts >= a) & (starts < b)
        eos = self.tokenizer.eos_id
        if len(ids) == 0 or ids[-1] != eos:
            ids = np.append(ids, eos)
            weighted = np.append(weighted, self.include_prompt)
        if (ids[:-1] == eos).any():
            raise MeshtronError(f"{where}: the rendered conversation holds the end-of-text "
                                f"token (id {eos}) that separates packed records")
        weighted[0] = False
        return np.where(weighted, ids, -ids - 1)


@dataclass
class PackedRecords:
    """Records packed whole into windows, and what packing them did."""

    windows: np.ndarray
    """int64 [n, seq_len + 1], tokens without loss stored as -(id + 1)."""
    records: int
    used: int = 0
    """Tokens of the records (the rest of the windows is padding)."""
    truncated: int = 0
    dropped: int = 0
    """Truncated records left with no token that carries loss (not packed)."""


def pack_records(records: list[tuple[str, np.ndarray]], size: int, eos_id: int,
                 truncate: bool) -> PackedRecords:
    """Records (where, encoded tokens) in file order into windows of ``size`` tokens: a record
    that does not fit the current window's rest starts the next one; rests are end-of-text
    padding without loss. A record longer than ``size`` is refused, or cut to ``size``."""
    windows: list[np.ndarray] = []
    current: list[np.ndarray] = []
    fill = used = truncated = dropped = 0
    pad = -eos_id - 1
    for where, tokens in records:
        if len(tokens) > size:
            if not truncate:
                raise MeshtronError(
                    f"{where}: the conversation is {len(tokens):,} tokens, more than a window "
                    f"of train.seq_len + 1 = {size:,}; raise train.seq_len or set "
                    "data.chat.long_records=truncate")
            tokens, truncated = tokens[:size], truncated + 1
            if not (tokens >= 0).any():
                dropped += 1
                continue
        if fill + len(tokens) > size:
            windows.append(np.concatenate(current + [np.full(size - fill, pad)]))
            current, fill = [], 0
        current.append(tokens)
        fill += len(tokens)
        used += len(tokens)
    if current:
        windows.append(np.concatenate(current + [np.full(size - fill, pad)]))
    stacked = np.stack(windows).astype(np.int64) if windows else np.zeros((0, size), np.int64)
    return PackedRecords(stacked, len(records) - dropped, used, truncated, dropped)


@dataclass
class ChatData:
    """Tokenizer plus training and validation windows of conversations, served as whole global
    batches (the trainer's interface of :class:`~meshtron.data.training_data.TrainingData`)."""

    tokenizer: Tokenizer
    train: np.ndarray
    valid: np.ndarray
    seq_len: int
    seed: int
    _samplers: dict[int, GlobalSampler] = field(default_factory=dict, repr=False)

    def train_batch(self, k: int, global_batch: int) -> torch.Tensor:
        """Global batch ``k`` [global_batch, seq_len + 1], a function of (seed, k) only."""
        if global_batch not in self._samplers:
            self._samplers[global_batch] = GlobalSampler(len(self.train), global_batch,
                                                         self.seed)
        return torch.from_numpy(self.train[self._samplers[global_batch].batch_indices(k)])

    def valid_batch(self, k: int, batch: int) -> torch.Tensor:
        """Validation batch ``k``: windows in fixed order, wrapping around at the end."""
        return torch.from_numpy(self.valid[np.arange(k * batch, (k + 1) * batch)
                                           % len(self.valid)])

    def resolved(self, cfg: Config) -> Config:
        """``cfg`` saying what this data is: chat format, records masked from each other."""
        data = dataclasses.replace(cfg.data, format="chat", document_mask=True)
        return dataclasses.replace(cfg, data=data)


def encode_files(encoder: ChatEncoder, paths: list[str]) -> list[tuple[str, np.ndarray]]:
    """Every record of ``paths`` (in order) as (file:line, encoded tokens)."""
    out = []
    for path in paths:
        location = Path(path).expanduser()
        if not location.is_file():
            raise MeshtronError(f"chat data {path} not found (data.format=chat reads JSONL "
                                "files)")
        for number, messages in read_records(location):
            where = f"{path}:{number}"
            out.append((where, encoder.encode(messages, where)))
    return out


def chat_paths(data: DataConfig) -> list[str]:
    """The JSONL files of ``data.path`` (blend weights have no meaning for conversations)."""
    if not data.path:
        raise MeshtronError("data.format=chat needs data.path, JSONL files of "
                            '{"messages": [{"role", "content"}, ...]}')
    entries = parse_blend(data.path)
    if any(weight != 1.0 for weight, _ in entries):
        raise MeshtronError("data.format=chat reads its files' records in order; blend weights "
                            "(w:path) are not supported for conversations")
    return [path for _, path in entries]


def build_chat_data(cfg: Config, log: Log = print) -> ChatData:
    """The trainer's entry point for conversations: the model's tokenizer (``data.tokenizer``)
    and its chat template, every record encoded, packed and split."""
    data, seq_len = cfg.data, cfg.train.seq_len
    paths = chat_paths(data)
    if not data.tokenizer:
        raise MeshtronError("data.format=chat needs the model's tokenizer and chat template: "
                            "set data.tokenizer (the train.yaml of meshtron convert does)")
    if cfg.model.mtp_depth or cfg.train.eval_generate:
        name = "model.mtp_depth" if cfg.model.mtp_depth else "train.eval_generate"
        raise MeshtronError(f"data.format=chat does not combine with {name} yet (both read "
                            "windows whose prompt tokens are stored as -(id + 1)); set it to 0")
    tokenizer = Tokenizer.load(data.tokenizer)
    template = find_chat_template(Path(tokenizer.path), data.chat.template)
    encoder = ChatEncoder(tokenizer, template, data.chat.include_prompt)
    packed = pack_records(encode_files(encoder, paths), seq_len + 1, tokenizer.eos_id,
                          data.chat.long_records == "truncate")
    n = len(packed.windows)
    if n < 2:
        raise MeshtronError(f"{', '.join(paths)} packs into {n} window(s) of "
                            f"train.seq_len + 1 = {seq_len + 1} tokens; training and "
                            "validation need at least 2 (add conversations or lower train.seq_len)")
    held = min(n - 1, max(1, round(n * data.valid_fraction)))
    log(f"tokenizer: {tokenizer.path} ({tokenizer.vocab_size} tokens), chat template from "
        f"{template.where}")
    log(f"dataset: {summary(packed, held)}")
    return ChatData(tokenizer, packed.windows[: n - held], packed.windows[n - held:], seq_len,
                    cfg.train.seed)


def summary(packed: PackedRecords, held: int) -> str:
    """``120 conversations in 40 windows (12.5% padding, 31.0% of tokens carry loss); 39 train,
    1 valid``, with truncated and dropped records when there were any."""
    windows = packed.windows
    pad = 1 - packed.used / windows.size if len(windows) else 0.0
    weighted = float((windows[:, 1:] >= 0).mean()) if len(windows) else 0.0
    extra = ""
    if packed.truncated:
        extra = f", {packed.truncated} truncated ({packed.dropped} left no answer, not used)"
    return (f"{packed.records:,} conversations{extra} in {len(windows):,} windows "
            f"({100 * pad:.1f}% padding, {100 * weighted:.1f}% of targets carry loss); "
            f"{len(windows) - held:,} train, {held:,} valid")
