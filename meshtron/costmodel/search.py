"""The layout search: every split of a cluster the trainer can run, pruned exactly, then ranked.

Enumeration walks tp, cp, pp (with vpp and the schedule), ep and etp, ZeRO and the micro-batch
size; a pinned field takes only its pinned value. Pruning is exact before anything is ranked:
divisibility as the plan checks it, and memory — the optimizer state of the largest stage is
known before activations, so a (tp, cp, pp, ep, zero) split whose state alone overflows is
dropped with every schedule and micro-batch under it. Among the recompute modes, which only
trade time for memory, each layout keeps the cheapest that fits. Sequence parallelism is on
whenever tp > 1 unless pinned off (the same communication as without, less memory), and GPipe
is tried only when pinned (1F1B runs the same pipeline in less memory).

Ranking is two-pass: a closed-form pipeline (the busiest stage over one minus the schedule's
theoretical bubble) orders every fitting candidate, then the best few are priced with the
schedule simulator and re-sorted, with the most promising zb-v twins of their pipelines
(:func:`v_twins`); the final plan and table use the simulated figures only, and each of them
passes the trainer's own plan checks (:func:`meshtron.plan.check_run`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from meshtron.config import Config
from meshtron.costmodel.candidate import Candidate, Pins
from meshtron.costmodel.estimate import Estimator, Problem
from meshtron.costmodel.priced import Estimate
from meshtron.costmodel.refusals import check_layout_free, divisibility_refusal, plan_refusal
from meshtron.errors import MeshtronError
from meshtron.models.flops import padded_vocab_size
from meshtron.plan import check_run

RECOMPUTE_ORDER = ("none", "selective", "full")
SIMULATED = 48
"""Candidates re-ranked with the schedule simulator after the closed-form pass."""
TWINS_SIMULATED = 4
"""zb-v twins of those (:func:`v_twins`) simulated at most."""


@dataclass
class SearchResult:
    ranked: list[Estimate]
    """Simulated candidates, fitting ones first, each group by step time."""
    considered: int
    """Layouts that passed divisibility (before memory pruning)."""
    fitting: int
    refusal: str = ""
    """Why nothing is ranked, when nothing is (divisibility or the plan; memory is the
    caller's report of ``ranked``'s least-memory layouts)."""
    plan_refused: Counter[str] = field(default_factory=Counter)
    """The trainer's plan's refusals of fitting layouts, by message."""


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


def divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def tp_sizes(problem: Problem, pins: Pins) -> list[int]:
    """The tp sizes that split the model's heads, FFN and vocabulary and the world."""
    m, gpus = problem.model, problem.gpus
    gpn = problem.profile.gpus_per_node
    return [tp for tp in pins.allow("tp", powers_of_two(min(gpn, m.num_heads)))
            if not (m.num_heads % tp or (m.num_kv_heads % tp and tp % m.num_kv_heads)
                    or m.ffn_hidden_size % tp or padded_vocab_size(m) % tp or gpus % tp)]


def _structures(problem: Problem, pins: Pins) -> Iterator[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) splits the model and the world divide into."""
    m, gpus = problem.model, problem.gpus
    for tp in tp_sizes(problem, pins):
        for cp in pins.allow("cp", powers_of_two(problem.seq_len // 2)):
            if problem.seq_len % (2 * cp) or gpus % (tp * cp):
                continue
            for pp in pins.allow("pp", divisors(gpus // (tp * cp), m.num_layers)):
                if gpus % (tp * cp * pp) == 0:
                    yield tp, cp, pp, gpus // (tp * cp * pp)


def _expert_splits(problem: Problem, pins: Pins, tp: int, cp: int,
                   dp: int) -> Iterator[tuple[int, int | None]]:
    m = problem.model
    if not m.is_moe:
        if pins.ep not in (None, 1):
            return
        yield 1, None
        return
    for etp in pins.allow("etp", [None, 1] if tp > 1 else [None]):
        if etp is not None and etp not in (1, tp):
            continue
        if etp != 1 and m.moe.expert_ffn_size % tp:
            continue
        folded = dp * cp * (tp if etp == 1 else 1)
        for ep in pins.allow("ep", divisors(m.moe.num_experts, folded)):
            if folded % ep == 0:
                yield ep, etp


def _pipelines(pins: Pins, pp: int, layers: int) -> list[tuple[int, str]]:
    if pp == 1:
        return [(1, "1f1b")] if pins.schedule in (None, "1f1b", "gpipe") and \
            pins.vpp in (None, 1) else []
    # zb-v is priced by simulation only: pinned here, else as the shortlist's twins (v_twins)
    schedules = [pins.schedule] if pins.schedule else ["1f1b", "zb-h1", "interleaved"]
    out = []
    for schedule in schedules:
        vpps = ([v for v in range(2, 5) if layers % (pp * v) == 0] if schedule == "interleaved"
                else [2] if schedule == "zb-v" and layers >= 2 * pp else [1])
        out += [(v, schedule) for v in pins.allow("vpp", vpps)
                if (v > 1) == (schedule in ("interleaved", "zb-v"))]
    return out


def _micro_batches(pins: Pins, share: int, pp: int, schedule: str) -> list[int]:
    """The micro-batch sizes that split a rank's ``share`` into counts the schedule runs."""
    out = []
    for mb in pins.allow("micro_batch", powers_of_two(min(share, 64))):
        count = share // mb if share % mb == 0 else 0
        if not count or (pp > 1 and schedule != "gpipe" and count < pp) \
                or (schedule == "interleaved" and count % pp):
            continue
        out.append(mb)
    return out


def layouts(problem: Problem, pins: Pins, keep: Callable[[Candidate], bool] | None = None,
            dropped: list[int] | None = None
            ) -> Iterator[tuple[tuple, list[int], list[str]]]:
    """Every layout that passes divisibility, as (its fields tp, cp, pp, vpp, schedule, ep,
    etp, dp, zero, sp; its micro-batch sizes; the recompute modes): :func:`candidates` without
    building the candidates, which the first pass builds only for what it prices. ``keep``,
    given, is asked once per layout (its first micro-batch and recompute mode standing for
    all): a layout it refuses is left out, its candidates counted in ``dropped[0]``."""
    gb, layers = problem.global_batch, problem.model.num_layers
    modes = pins.allow("recompute", list(RECOMPUTE_ORDER))
    for tp, cp, pp, dp in _structures(problem, pins):
        if gb % dp:
            continue
        share = gb // dp
        for ep, etp in _expert_splits(problem, pins, tp, cp, dp):
            can_split = tp > 1 and (problem.seq_len // cp) % tp == 0
            for sp in pins.allow("sp", [can_split]):
                if sp and not can_split:
                    continue
                for zero in pins.allow("zero", [0, 1, 2, 3] if dp * cp > 1 else [0]):
                    for vpp, schedule in _pipelines(pins, pp, layers):
                        if schedule in ("zb-h1", "zb-v") and zero == 3 and dp * cp > 1:
                            continue
                        sizes = _micro_batches(pins, share, pp, schedule)
                        if not sizes:
                            continue
                        fields = (tp, cp, pp, vpp, schedule, ep, etp, dp, zero, sp)
                        if keep is not None and dropped is not None and not keep(
                                Candidate(*fields, sizes[0], modes[0])):
                            dropped[0] += len(sizes) * len(modes)
                            continue
                        yield fields, sizes, modes


def candidates(problem: Problem, pins: Pins, keep: Callable[[Candidate], bool] | None = None,
               dropped: list[int] | None = None) -> Iterator[Candidate]:
    """Every candidate that passes divisibility (memory is not checked here); ``keep`` and
    ``dropped``: see :func:`layouts`."""
    for fields, sizes, modes in layouts(problem, pins, keep, dropped):
        for mb in sizes:
            for recompute in modes:
                yield Candidate(*fields, mb, recompute)


def search(problem: Problem, pins: Pins, cfg: Config, *, simulate: int = SIMULATED,
           prune: bool = True) -> SearchResult:
    """Rank every layout of ``problem`` that the trainer can run (``cfg`` gives the rest of
    the run's settings for the plan checks). ``prune=False`` prices every layout's memory
    (the reference the pruned search is tested against; the answer is the same)."""
    check_layout_free(cfg, problem)
    estimator = Estimator(problem)
    limit = problem.memory_limit
    fits = FirstPass(problem, pins, estimator, prune)
    first_pass, spill, considered = fits.run()
    if prune and not first_pass:  # nothing fits: the report wants every least-memory layout
        return search(problem, pins, cfg, simulate=simulate, prune=False)
    first_pass.sort(key=lambda item: item[0])
    ranked: list[Estimate] = []
    refused: Counter[str] = Counter()
    checks = PlanChecks(cfg, problem.gpus)
    for _, c in first_pass:
        if len(ranked) >= simulate:
            break
        error = checks.error(c)
        if error is None:
            ranked.append(estimator.estimate(c))
        else:
            refused[error] += 1
    fitting = len(first_pass)
    twins = v_twins(estimator, pins, checks, ranked, limit)
    considered, fitting = considered + twins.tried, fitting + twins.fitting
    ranked += twins.simulated
    refusal = ""
    if not ranked and refused:
        refusal = plan_refusal(refused, len(first_pass))
    elif not ranked:
        ranked = least_memory(estimator, spill)
        if not ranked:
            refusal = why_nothing_divides(problem, pins)
    # equal times (cp re-splitting what dp would) go to the simpler layout
    ranked.sort(key=lambda e: (not e.fits, e.step_time_s, e.candidate.cp, e.candidate.pp,
                               e.candidate.zero, e.candidate.tp))
    return SearchResult(ranked, considered, fitting, refusal, refused)


class FirstPass:
    """The search's first pass: every layout that fits, with the least recompute that fits,
    priced in closed form; and the least-memory ones that do not fit, for the report.

    Pruning is exact (``prune``): a layout whose optimizer state alone overflows is dropped
    with every schedule, micro-batch and recompute mode under it; and along the micro-batch
    sizes of one layout (enumerated smallest first) memory only grows, so once a recompute
    mode overflows at one size it overflows at every larger one, and once even full recompute
    overflows, every larger size is dropped unpriced."""

    def __init__(self, problem: Problem, pins: Pins, estimator: Estimator, prune: bool):
        self.problem, self.pins, self.estimator, self.prune = problem, pins, estimator, prune
        self.state_fits: dict[tuple, bool] = {}
        self.least: dict[tuple, int] = {}
        """Per layout but the micro-batch: the index (in :data:`RECOMPUTE_ORDER`) of the
        least recompute that fit at the last size; past the last mode: none fits."""

    def state_fit(self, c: Candidate) -> bool:
        """The optimizer state of the layout's largest stage leaves room below the limit."""
        key = (c.tp, c.cp, c.pp, c.vpp, c.vshape, c.ep, c.etp, c.zero)
        if key not in self.state_fits:
            pr, est = self.problem, self.estimator
            _, _, unique = est.pipeline(c)
            worst = max(est.stage_state(c, s)[1] for s in unique.values())
            self.state_fits[key] = worst * pr.profile.memory_correction \
                + pr.reserved_bytes <= pr.memory_limit
        return self.state_fits[key]

    def run(self) -> tuple[list[tuple[float, Candidate]], list[Candidate], int]:
        """(closed-form seconds and candidate of each fitting layout, the non-fitting ones
        with full recompute (or the pinned mode), layouts that divide)."""
        pr, pins, est, limit = self.problem, self.pins, self.estimator, self.problem.memory_limit
        considered, first_pass, spill = 0, [], []
        kept: set[tuple] = set()
        dropped = [0]  # candidates of layouts whose state alone overflows, left unenumerated
        for fields, sizes, modes in layouts(pr, pins, self.state_fit if self.prune else None,
                                            dropped):
            key = (*fields[:4], fields[4] == "zb-v", *fields[5:7], fields[8])
            for mb in sizes:
                layout = (*key, fields[4], fields[9], mb)
                for recompute in modes:
                    considered += 1
                    if layout in kept:  # a cheaper recompute mode of this layout already fits
                        continue
                    family, mode = layout[:-1], RECOMPUTE_ORDER.index(recompute)
                    if self.prune and mode < self.least.get(family, 0):
                        continue  # overflowed at a smaller micro-batch: overflows here too
                    c = Candidate(*fields, mb, recompute)
                    if not (self.prune or self.state_fit(c)):  # pruned: layouts() asked
                        if recompute == "full":
                            spill.append(c)
                        continue
                    if est.peak_bytes(c) > limit:
                        if recompute == "full" or pins.recompute:
                            spill.append(c)
                        self.least[family] = max(self.least.get(family, 0), mode + 1)
                        continue
                    kept.add(layout)
                    self.least[family] = mode
                    first_pass.append((est.step_parts(c, simulate=False)[-1], c))
        return first_pass, spill, considered + dropped[0]


def why_nothing_divides(problem: Problem, pins: Pins) -> str:
    """:func:`divisibility_refusal` of the enumeration, walked again (only when it is empty)."""
    structures = list(_structures(problem, pins))
    batched = [s for s in structures if problem.global_batch % s[3] == 0]
    split = any(any(True for _ in _expert_splits(problem, pins, tp, cp, dp))
                for tp, cp, _, dp in batched)
    sp = pins.sp is not True or any(tp > 1 and problem.seq_len // cp % tp == 0
                                    for tp, cp, _, _ in batched)
    return divisibility_refusal(problem, pins, tp_sizes(problem, pins), structures, split, sp)


@dataclass
class Twins:
    tried: int
    """zb-v layouts priced (memory, then the closed form)."""
    fitting: int
    simulated: list[Estimate]
    """The most promising of those whose closed form beats the shortlist's best, simulated."""


def v_twins(estimator: Estimator, pins: Pins, checks: PlanChecks, shortlist: list[Estimate],
            limit: float) -> Twins:
    """The zb-v layouts of the shortlist's pipelines: the same split with its two chunks per
    stage in a V, each with the least recompute that fits.

    zb-v is not ranked beside the other schedules in the closed-form pass: its closed form
    (one unit-cost V) is optimistic where the chunks differ (a head, chunks of 2 and 1 layers),
    and there it crowded better layouts out of the shortlist. Here it orders the twins instead:
    of those whose closed form beats the shortlist's best, the :data:`TWINS_SIMULATED` lowest
    are simulated and plan-checked."""
    layers = estimator.problem.model.num_layers
    fitting_times = [e.step_time_s for e in shortlist if e.fits]
    if pins.schedule is not None or pins.vpp not in (None, 2) or not fitting_times:
        return Twins(0, 0, [])
    best = min(fitting_times)
    seen: set[Candidate] = set()
    tried, fitting, promising = 0, 0, []
    for c in (e.candidate for e in shortlist):
        if c.pp == 1 or layers < 2 * c.pp or (c.zero == 3 and c.dp * c.cp > 1):
            continue
        base = dataclasses.replace(c, vpp=2, schedule="zb-v", recompute="none")
        if base in seen:
            continue
        seen.add(base)
        for recompute in pins.allow("recompute", list(RECOMPUTE_ORDER)):
            twin = dataclasses.replace(base, recompute=recompute)
            tried += 1
            if estimator.memory(twin).peak > limit:
                continue
            fitting += 1
            closed = estimator.estimate(twin, simulate=False).step_time_s
            if closed < best:
                promising.append((closed, twin))
            break
    promising.sort(key=lambda item: item[0])
    simulated = [estimator.estimate(twin) for _, twin in promising[:TWINS_SIMULATED]
                 if checks.error(twin) is None]
    return Twins(tried, fitting, simulated)


def least_memory(estimator: Estimator, spill: list[Candidate], keep: int = 5) -> list[Estimate]:
    """The layouts closest to fitting, for the report that nothing fits."""
    if not spill:
        return []
    scored = sorted(spill, key=lambda c: estimator.memory(c).peak)
    return [estimator.estimate(c) for c in scored[:keep]]


def runnable(cfg: Config, c: Candidate, gpus: int) -> bool:
    """The trainer's plan accepts the candidate."""
    return plan_error(cfg, c, gpus) is None


class PlanChecks:
    """:func:`plan_error` once per layout: the plan is asked with the fewest micro-batches
    whatever the micro-batch size, reads no recompute mode and of ZeRO only whether it is
    stage 3, so layouts differing only in those get one answer (each check builds the
    pipeline's schedule: 0.2 s at pp=32)."""

    def __init__(self, cfg: Config, gpus: int):
        self.cfg, self.gpus = cfg, gpus
        self.answers: dict[Candidate, str | None] = {}

    def error(self, c: Candidate) -> str | None:
        key = dataclasses.replace(c, micro_batch=1, recompute="none", zero=min(c.zero, 3) // 3)
        if key not in self.answers:
            self.answers[key] = plan_error(self.cfg, c, self.gpus)
        return self.answers[key]


def plan_error(cfg: Config, c: Candidate, gpus: int) -> str | None:
    """Why the trainer's plan refuses the candidate, or None. The enumeration has checked the
    batch split already, so the plan is asked with the fewest micro-batches the schedule
    takes: every other check is the same, and building a schedule of hundreds of
    micro-batches is not. Nor does any check read ``parallel.receives_ahead``, so an unset one
    is not worked out."""
    fewest = 1 if c.pp == 1 else c.pp
    small = dataclasses.replace(cfg.train, global_batch=c.dp * c.micro_batch * fewest)
    checked = apply(dataclasses.replace(cfg, train=small), c)
    if checked.parallel.receives_ahead is None:  # no check reads it; finding the need
        # simulates the schedule twice more
        checked = dataclasses.replace(checked, parallel=dataclasses.replace(
            checked.parallel, receives_ahead=0))
    try:
        check_run(checked, gpus)
    except MeshtronError as err:
        return str(err)
    return None


def apply(cfg: Config, c: Candidate) -> Config:
    """``cfg`` with the candidate's layout, micro-batch and recompute mode."""
    parallel = dataclasses.replace(cfg.parallel, tp=c.tp, cp=c.cp, pp=c.pp, vpp=c.vpp,
                                   schedule=c.schedule, ep=c.ep, etp=c.etp, zero=c.zero,
                                   sp=c.sp, pp_layers=None)
    train = dataclasses.replace(cfg.train, micro_batch=c.micro_batch, recompute=c.recompute)
    return dataclasses.replace(cfg, parallel=parallel, train=train)
