"""Why the layout search found nothing: the check that removed the most candidates, with its
numbers, instead of a generic "no layout divides".

Three places can empty the search. A check that no layout changes (the model's positions,
the architecture's needs) refuses every candidate alike, so it is made once, before the
search, and names itself (:func:`check_layout_free`). Divisibility empties the enumeration:
:func:`divisibility_refusal` walks it again level by level (tp, cp, pp, the batch over dp, the
experts, the micro-batches a pipeline needs) and names the first level nothing passes. The
trainer's plan may refuse every candidate that fits: :func:`plan_refusal` names its most
frequent message. Memory has its own report (``meshtron tune``'s "does not fit").
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from meshtron.config import MODEL_PRESETS, Config
from meshtron.costmodel.candidate import Pins
from meshtron.errors import MeshtronError
from meshtron.models.flops import padded_vocab_size
from meshtron.plan import check_model

if TYPE_CHECKING:
    from meshtron.costmodel.problem import Problem


def long_context_presets(seq_len: int) -> list[str]:
    """The published (non-tiny) presets whose positions cover ``seq_len``."""
    return [name for name, shape in MODEL_PRESETS.items()
            if shape.get("max_seq_len", 0) >= seq_len and not name.startswith("tiny")]


def check_layout_free(cfg: Config, problem: Problem) -> None:
    """The plan's checks that no layout changes, once before the search: otherwise every
    candidate is refused one by one (a 405B model at 128K positions plans 68,000 layouts) and
    the answer names no cause."""
    m, seq = problem.model, problem.seq_len
    if seq > m.max_seq_len:
        longer = long_context_presets(seq)
        hint = f" ({', '.join(longer)})" if longer else ""
        raise MeshtronError(f"model.max_seq_len {m.max_seq_len:,} < train.seq_len {seq:,}: every "
                            f"layout refused; set --model.max_seq_len or use a long-context "
                            f"preset{hint}")
    try:
        check_model(cfg)
    except MeshtronError as err:
        raise MeshtronError(f"every layout refused: {err}") from None


def plan_refusal(messages: Counter[str], fitting: int) -> str:
    """Every fitting layout refused by the trainer's plan: its most frequent reason."""
    text, count = messages.most_common(1)[0]
    return (f"the trainer's plan refused every layout that fits ({count:,} of {fitting:,} "
            f"checked: {text})")


def _powers(limit: int) -> list[int]:
    out, p = [], 1
    while p <= max(limit, 1):
        out.append(p)
        p *= 2
    return out


def _pinned(pins: Pins) -> str:
    fixed = {k: v for k, v in vars(pins).items() if v is not None}
    return (" with the pins " + ", ".join(f"{k}={v}" for k, v in fixed.items())) if fixed else ""


def _tp_refusal(problem: Problem, pins: Pins) -> str:
    m, gpn = problem.model, problem.profile.gpus_per_node
    options = pins.allow("tp", _powers(min(gpn, m.num_heads)))
    return (f"no tp in {options} divides model.num_heads {m.num_heads}, model.num_kv_heads "
            f"{m.num_kv_heads} (or is divided by it), model.ffn_hidden_size "
            f"{m.ffn_hidden_size}, the padded vocabulary {padded_vocab_size(m)} and the "
            f"{problem.gpus:,} GPUs")


def divisibility_refusal(problem: Problem, pins: Pins, tps: list[int],
                         structures: list[tuple[int, int, int, int]], experts_split: bool,
                         sp_splits: bool = True) -> str:
    """The first level of the enumeration that nothing passes, with its numbers: ``tps`` the
    tp sizes that divide the model, ``structures`` the (tp, cp, pp, dp) splits, and
    ``experts_split`` whether any of those with a whole batch share splits the experts,
    ``sp_splits`` whether pinned sequence parallelism can split any of their sequences."""
    m, gpus, gb = problem.model, problem.gpus, problem.global_batch
    pinned = _pinned(pins)
    if not tps:
        return f"no layout of {gpus:,} GPUs divides this model{pinned}: " \
            + _tp_refusal(problem, pins)
    if not structures:
        return (f"no layout of {gpus:,} GPUs divides this model{pinned}: after tp in {tps}, "
                f"no cp divides train.seq_len {problem.seq_len:,} / 2 and no pp divides "
                f"model.num_layers {m.num_layers} and the GPUs left")
    dps = sorted({dp for *_, dp in structures})
    batched = [s for s in structures if gb % s[3] == 0]
    if not batched:
        return (f"train.global_batch {gb:,} is not a multiple of any data-parallel size the "
                f"{gpus:,} GPUs leave{pinned} (dp in {dps[:8]}); set --train.global_batch to a "
                f"multiple of {dps[0]}")
    if not experts_split:
        return (f"no expert-parallel size divides model.moe.num_experts {m.moe.num_experts} and "
                f"the data-parallel ranks of the layouts{pinned}")
    if not sp_splits:
        return (f"parallel.sp=true needs tp > 1 dividing train.seq_len / cp "
                f"({problem.seq_len:,} / cp), and no layout{pinned} has one; leave parallel.sp "
                "unset or pin parallel.tp > 1")
    shares = sorted({gb // dp for *_, dp in batched})
    return (f"no layout of {gpus:,} GPUs runs this batch{pinned}: each data-parallel rank gets "
            f"{shares[:6]} sequences, too few micro-batches for the pipelines (pp in "
            f"{sorted({pp for _, _, pp, _ in batched})[:8]}: 1F1B needs at least pp); raise "
            "train.global_batch or pin a smaller parallel.pp")
