"""What one layout holds per rank at its peak: the memory half of
:class:`meshtron.costmodel.estimate.Estimator`, kept apart so each half stays one job.

Per stage shape (:mod:`meshtron.costmodel.stages`) the persistent state, the transient buffers
and the activations of the micro-batches a schedule keeps in flight
(:meth:`MemoryPricing.in_flight`, from the order of its compute alone) are priced once and
shared by every candidate that has them, since the search asks for hundreds of thousands of
peaks (docs/tuning.md, "Memory").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.memory_model import (
    MemoryEstimate,
    StageParams,
    collective_copy_bytes,
    layer_activation_bytes,
    peak_total,
    stage_params,
    state_bytes,
    transient_bytes,
)
from meshtron.costmodel.priced import ActionCosts, Software
from meshtron.costmodel.problem import Problem
from meshtron.costmodel.stages import ChunkShape, StageShape, zb_v_order_costs
from meshtron.parallel.pipeline import schedules
from meshtron.parallel.pipeline.partition import PipelinePartition
from meshtron.parallel.pipeline.schedules import Schedule


class MemoryPricing:
    """The peak of a candidate's memory, with the caches candidates share. Mixed into
    :class:`~meshtron.costmodel.estimate.Estimator`, which provides the problem, the software,
    the pipeline's partition and schedules, and the chunks' costs."""

    problem: Problem
    software: Software
    dense_layer: int | None
    moe_layer: int | None
    _shape_index: dict[tuple, list[int]]
    # the Estimator's methods this half calls (declared, not defined here)
    pipeline: Callable[[Candidate], tuple[PipelinePartition, list[StageShape],
                                          dict[StageShape, int]]]
    schedule: Callable[[Candidate, int, Sequence[tuple[float, float, float]] | None], Schedule]
    chunk_costs: Callable[[Candidate], dict[ChunkShape, ActionCosts]]

    def init_memory_caches(self) -> None:
        self._stage_params: dict[tuple, StageParams] = {}
        self._activations: dict[tuple, float] = {}
        self._in_flight: dict[tuple, list[int]] = {}
        self._receives_ahead: dict[tuple, int] = {}
        self._stage_receives: dict[tuple, list[float]] = {}
        self._stage_buffers: dict[tuple, list[tuple[int, float, float]]] = {}
        self._peak_stages: dict[tuple, list[int]] = {}
        self._stage_state: dict[tuple, tuple[dict[str, float], float, float]] = {}
        self._shape_bytes: dict[tuple, list[tuple[dict[str, float], float, float, float]]] = {}
        """Per layout and micro-batch, each stage shape's (state, its sum, transient,
        collective copies) bytes, shared by the schedules, sp and recompute modes."""
        self._shape_activations: dict[tuple, list[tuple[float, float]]] = {}
        """Per split, micro-batch, sp and recompute mode, each stage shape's activations per
        micro-batch in flight and the extra of a layer being recomputed (any dp, ZeRO)."""
        self._last_memory: tuple[tuple[Candidate, bool], MemoryEstimate] | None = None
        """The last peak priced: the search asks for it again in the candidate's estimate."""

    def in_flight(self, c: Candidate, microbatches: int, ordered: bool = False) -> list[int]:
        """Micro-batches each stage keeps in flight at its peak: all of them under GPipe, else
        what the schedule's warm-up holds (it stops growing after a few rounds). ``ordered``:
        zb-v's order made for the chunks' costs, as the plan makes it (it may admit one
        micro-batch more); else the order for equal chunks, which the first pass prices."""
        if c.pp == 1:
            return [1]
        if c.schedule == "gpipe":
            return [microbatches] * c.pp
        m = min(microbatches, 4 * c.pp)
        order = None
        if c.vshape and ordered:
            _, shapes, _ = self.pipeline(c)
            order = tuple(zb_v_order_costs(c, shapes, self.chunk_costs(c)))
        key = (c.schedule, c.pp, c.vpp, m, order)
        if key not in self._in_flight:  # the compute order alone (no sends and receives)
            self._in_flight[key] = Schedule(c.schedule, c.pp, c.vpp, m, schedules._generate(
                c.schedule, c.pp, c.vpp, m, order)).peak_in_flight()
        return self._in_flight[key]

    def posted_receives(self, c: Candidate, stage: int) -> float:
        """Bytes of a stage's pipeline receives posted ahead of their consumers
        (``build_schedule``'s default): that many hidden-state messages on every stream the
        stage receives on (from the stage before, from the stage after; both on every stage
        when interleaved), beyond the consumed one its activations count."""
        if c.pp == 1:
            return 0.0
        key = (c.schedule, c.pp, c.vpp)
        if key not in self._receives_ahead:  # at most 1 unless interleaved; an interleaved
            # schedule's need peaks from 4 * pp micro-batches on, found as build_schedule does
            self._receives_ahead[key] = 1 if c.vpp == 1 else schedules.receives_ahead_needed(
                self.schedule(c, 4 * c.pp, None))
        wraps = c.vpp > 1 and not c.vshape  # looped chunks: every stage has both peers
        streams = (stage > 0 or wraps) + (stage < c.pp - 1 or wraps)
        return self._receives_ahead[key] * self.stage_message_bytes(c) * streams

    def stage_receives(self, c: Candidate) -> list[float]:
        """:meth:`posted_receives` of every stage, shared by the candidates of one schedule
        and message size (every ZeRO stage, dp and recompute mode)."""
        key = (c.schedule, c.pp, c.vpp, c.tp, c.cp, c.sp, c.micro_batch)
        if key not in self._stage_receives:
            self._stage_receives[key] = [self.posted_receives(c, s) for s in range(c.pp)]
        return self._stage_receives[key]

    def stage_message_bytes(self, c: Candidate) -> float:
        """One micro-batch's hidden states between pipeline stages on one rank: this rank's
        share of the sequence (over cp, and over tp under sequence parallelism)."""
        pr = self.problem
        tokens = c.micro_batch * pr.seq_len / c.cp
        return tokens * pr.model.hidden_size * pr.element_size / (c.tp if c.sp else 1)

    def peak_candidates(self, c: Candidate, in_flight: list[int]) -> list[int]:
        """The stages, in order, that can hold the peak: of each stage shape its first stage
        and its first with the most micro-batches in flight. A stage's memory grows with its
        micro-batches in flight, so no other stage of the shape is higher, nor equal and
        earlier; pricing only these keeps a deep pipeline's search from visiting every stage
        of every candidate."""
        key = (c.pp, c.vpp, c.vshape, tuple(in_flight))
        if key not in self._peak_stages:
            first: dict[int, int] = {}
            most: dict[int, int] = {}
            for s, number in enumerate(self._shape_index[(c.pp, c.vpp, c.vshape)]):
                first.setdefault(number, s)
                if number not in most or in_flight[s] > in_flight[most[number]]:
                    most[number] = s
            self._peak_stages[key] = sorted({*first.values(), *most.values()})
        return self._peak_stages[key]

    def stage_params(self, c: Candidate, stage: int) -> StageParams:
        key = (c.pp, c.vpp, c.vshape, stage)
        if key not in self._stage_params:
            part, _, _ = self.pipeline(c)
            held = part.stage_layers(stage)
            layers = [i for chunk in held.chunks for i in chunk]
            self._stage_params[key] = stage_params(self.problem.model, layers, held.embedding,
                                                   held.head, c.pp)
        return self._stage_params[key]

    def layer_activations(self, layer: int | None, c: Candidate, recompute: str) -> float:
        if layer is None:
            return 0.0
        key = (layer, c.tp, c.cp, c.sp, c.micro_batch, recompute)
        if key not in self._activations:
            self._activations[key] = layer_activation_bytes(
                self.problem.model, layer, dataclasses.replace(c, recompute=recompute),
                self.problem.seq_len, self.problem.element_size, self.software.selective,
                self.software.selective_every)
        return self._activations[key]

    def shape_activations(self, c: Candidate) -> list[tuple[float, float]]:
        """Per distinct stage shape: its largest chunk's activations per micro-batch in
        flight, and one layer's whole activations while it is recomputed (full, or a
        selective style that recomputes whole blocks or every operator)."""
        key = (c.pp, c.vpp, c.vshape, c.tp, c.cp, c.sp, c.micro_batch, c.recompute)
        if key not in self._shape_activations:
            _, _, unique = self.pipeline(c)
            dense = self.layer_activations(self.dense_layer, c, c.recompute)
            moe = self.layer_activations(self.moe_layer, c, c.recompute)
            redone = c.recompute == "full" or (c.recompute == "selective"
                                               and self.software.selective != "core")
            self._shape_activations[key] = [
                (max(k.dense * dense + k.moe * moe for k in shape.chunks),
                 self.layer_activations(self.moe_layer if shape.chunks[0].moe
                                        else self.dense_layer, c, "none") if redone else 0.0)
                for shape in unique]
        return self._shape_activations[key]

    def stage_state(self, c: Candidate, stage: int) -> tuple[dict[str, float], float, float]:
        """A stage's persistent bytes by kind, their sum, and the backend's copies of its
        queued reduce-scatters: the same for every schedule, micro-batch, sp and recompute
        mode of a layout (the search's state check, memory and the optimizer step share it)."""
        key = (c.pp, c.vpp, c.vshape, stage, c.tp, c.cp, c.dp, c.ep, c.etp, c.zero)
        if key not in self._stage_state:
            pr, params = self.problem, self.stage_params(c, stage)
            state = state_bytes(params, c, pr.element_size, pr.reduce_size)
            self._stage_state[key] = state, sum(state.values()), collective_copy_bytes(
                params, c, pr.reduce_size, pr.profile.reduce_scatter_copy)
        return self._stage_state[key]

    def shape_bytes(self, c: Candidate) -> list[tuple[dict[str, float], float, float, float]]:
        """Per distinct stage shape: (state by kind, its sum, transient, collective copies)."""
        key = (c.pp, c.vpp, c.vshape, c.tp, c.cp, c.dp, c.ep, c.etp, c.zero, c.micro_batch)
        if key not in self._shape_bytes:
            pr, (_, _, unique) = self.problem, self.pipeline(c)
            rows = []
            for shape, first in unique.items():
                state, held, copies = self.stage_state(c, first)
                rows.append((state, held, transient_bytes(
                    pr.model, self.stage_params(c, first), c, pr.seq_len, shape.head,
                    pr.element_size, pr.reduce_size), copies))
            self._shape_bytes[key] = rows
        return self._shape_bytes[key]

    def stage_buffers(self, c: Candidate, stage: int | None, ordered: bool
                      ) -> list[tuple[int, float, float]]:
        """Of each stage that can hold the peak (or of ``stage``): (its shape's index, its
        activations, its posted receives) bytes; the same for every ZeRO stage and expert
        split of a layout, so shared by them."""
        key = (c.schedule, c.pp, c.vpp, c.tp, c.cp, c.dp, c.sp, c.micro_batch, c.recompute,
               stage, ordered)
        if key not in self._stage_buffers:
            in_flight = self.in_flight(c, c.microbatches(self.problem.global_batch), ordered)
            acts, receives = self.shape_activations(c), self.stage_receives(c)
            index = self._shape_index[(c.pp, c.vpp, c.vshape)]
            stages = [stage] if stage is not None else self.peak_candidates(c, in_flight)
            self._stage_buffers[key] = [
                (index[s], in_flight[s] * acts[index[s]][0] + acts[index[s]][1], receives[s])
                for s in stages]
        return self._stage_buffers[key]

    def worst_stage(self, c: Candidate, stage: int | None, ordered: bool
                    ) -> tuple[dict[str, float], float, float, float]:
        """(state by kind, activations, transient, collective copies) bytes of the stage that
        holds the peak (or of ``stage``)."""
        shape_bytes = self.shape_bytes(c)
        slack = self.problem.profile.memory_step_slack
        worst, peak = None, -1.0
        for number, activations, received in self.stage_buffers(c, stage, ordered):
            state, held, transient, copies = shape_bytes[number]
            transient += received
            total = held + (1 + slack) * max(activations + transient, copies)
            if total > peak:
                worst, peak = (state, activations, transient, copies), total
        assert worst is not None
        return worst

    def peak_bytes(self, c: Candidate) -> float:
        """``memory(c).peak`` without building the estimate (the search's first pass)."""
        pr = self.problem
        state, activations, transient, copies = self.worst_stage(c, None, False)
        return peak_total(state["params"] + state["grads"] + state["master"]
                          + state["optimizer"], activations, transient, copies,
                          pr.profile.memory_step_slack, pr.profile.memory_correction,
                          pr.reserved_bytes)

    def memory(self, c: Candidate, stage: int | None = None,
               ordered: bool = False) -> MemoryEstimate:
        """The peak over stages, or the peak of pipeline stage ``stage`` (a trainer's memory
        figure is rank 0's, which holds stage 0); ``ordered``: see :meth:`in_flight`."""
        if stage is None and self._last_memory and self._last_memory[0] == (c, ordered):
            return self._last_memory[1]
        pr = self.problem
        state, activations, transient, copies = self.worst_stage(c, stage, ordered)
        peak = MemoryEstimate(**state, activations=activations, transient=transient,
                              reserved=pr.reserved_bytes,
                              correction=pr.profile.memory_correction,
                              collective_copies=copies, slack=pr.profile.memory_step_slack)
        if stage is None:
            self._last_memory = (c, ordered), peak
        return peak
