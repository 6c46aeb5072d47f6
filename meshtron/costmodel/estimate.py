"""Step time and memory of one layout: the cost model that ranks the search and plans the run.

Each pipeline action is priced from its layers' work (:mod:`meshtron.costmodel.workload`) at the
profile's GEMM efficiency for its size (on a GPU, for its shape: the backward at the forward's
transposed products, :mod:`meshtron.costmodel.gemm_shape`), plus the tensor-, context- and
expert-parallel communication it waits for (:mod:`meshtron.costmodel.comms`) and the receive of
its input from the neighbouring stage. The pipeline's time is the makespan of the schedule
simulator (:meth:`Schedule.timeline`) over those per-stage costs, the last stage's head and loss
included; runs with very many micro-batches are simulated at two small counts and extended along
the line through them, since each extra micro-batch adds the same steady-state time. After the
pipeline come the data-parallel reductions that did not overlap the last backward, the ZeRO
all-gather of updated parameters, and the optimizer step (bound by memory bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.comms import collective_seconds, layout_groups, send_seconds
from meshtron.costmodel.estimate_memory import MemoryPricing
from meshtron.costmodel.gather_formats import LowPrecisionGather, low_precision_gather
from meshtron.costmodel.layer_comms import edge_communication, layer_communication
from meshtron.costmodel.memory_model import (
    rank_params,
)
from meshtron.costmodel.priced import ActionCosts, Estimate, Software
from meshtron.costmodel.problem import Problem
from meshtron.costmodel.recompute import recomputed_gemm_shares, recomputed_seconds
from meshtron.costmodel.stages import (
    ChunkShape,
    StageShape,
    representative_layers,
    stage_shapes,
    zb_v_order_costs,
)
from meshtron.costmodel.workload import (
    LayerWork,
    head_work,
    layer_work,
    mtp_merge_work,
    transposed,
)
from meshtron.models.flops import layer_and_head_cost
from meshtron.parallel.pipeline.partition import PipelinePartition, partition_layers
from meshtron.parallel.pipeline.schedules import Action, Schedule, build_schedule

SIMULATED_MICROBATCHES = 24
"""Above this many micro-batches the pipeline is simulated at two counts and extended."""
UNFUSED_SCORE_PASSES = 6
"""Times an unfused attention's forward moves each score element through memory: the
product writes it, the scaled, masked softmax reads and writes it, dropout reads it and writes
it with its mask, and the product with v reads it."""


class Estimator(MemoryPricing):
    """Prices candidates of one problem, caching what candidates share (partitions and stage
    shapes, layer costs, stage parameters)."""

    def __init__(self, problem: Problem, software: Software | None = None,
                 pp_layers: tuple[float, ...] | None = None):
        self.problem = problem
        self.software = software or Software()  # None: meshtron's own trainer
        self.pp_layers = pp_layers
        """An explicit layer split (``parallel.pp_layers``) for the pipelines of its length."""
        self.dense_layer, self.moe_layer = representative_layers(problem.model)
        self._pipelines: dict[tuple[int, int], tuple[PipelinePartition, list[StageShape],
                                                     dict[StageShape, int]]] = {}
        self._layers: dict[tuple, tuple[float, float, float, float]] = {}
        self._dp: dict[tuple, tuple[tuple[tuple[float, float, float], ...], float]] = {}
        self._chunks: dict[tuple, dict[ChunkShape, ActionCosts]] = {}
        self._totals: dict[tuple, tuple[float, float, tuple[float, float]]] = {}
        self._schedules: dict[tuple, Schedule] = {}
        self._shape_index: dict[tuple, list[int]] = {}
        self.init_memory_caches()

    # ------------------------------------------------------------------ compute

    def rate_scale(self, c: Candidate) -> float:
        """CPU ranks share the node's cores: one rank uses them all, more split them."""
        units = self.problem.profile.compute_units
        if units is None:
            return 1.0
        ranks = min(c.world_size, self.problem.profile.gpus_per_node)
        return self.problem.profile.thread_speedup if ranks == 1 else min(1.0, units / ranks)

    @property
    def overlaps(self) -> bool:
        """Whether communication can hide behind compute. A GPU's collectives run beside its
        kernels (NCCL on its own streams); a CPU rank's collectives (gloo copying, reducing
        and driving the sockets) take the cores that its compute uses, and the ranks take every
        core (:meth:`rate_scale`), so there they add to the compute time."""
        return self.problem.profile.compute_units is None

    def _gemm_seconds(self, work: LayerWork, scale: float, direction: int = 0) -> list[float]:
        """Seconds of each of ``work``'s GEMMs, in its order: forward (``direction`` 0), the
        input gradient's products (1: (m, k) outputs over n) or the weight gradient's (2:
        (k, n) outputs over the m tokens). A profile without a shape model (a CPU's) prices
        all three at the forward's FLOPs."""
        p = self.problem.profile
        dtype = self.problem.gemm_dtype
        peak = p.peak(dtype) * scale / p.compute_correction
        if p.sm_count is None:
            return [g.count * g.flops / (peak * p.gemm_fraction(g.flops)) for g in work.gemms]
        return [g.count * sum(2.0 * m * n * k / (peak * p.gemm_shape_fraction(
            *transposed(m, n, k, direction), dtype)) for m, n, k in g.shapes)
            for g in work.gemms]

    def gemm_directions(self, work: LayerWork, scale: float) -> tuple[float, float, float]:
        """(forward, input-gradient, weight-gradient) seconds of ``work``'s GEMMs."""
        return (sum(self._gemm_seconds(work, scale, 0)), sum(self._gemm_seconds(work, scale, 1)),
                sum(self._gemm_seconds(work, scale, 2)))

    def _work_seconds(self, work: LayerWork, scale: float) -> tuple[float, float, float]:
        """(GEMMs, attention core, memory-bound) forward seconds of ``work``."""
        p = self.problem.profile
        gemm = sum(self._gemm_seconds(work, scale))
        scale = scale / p.compute_correction
        if self.software.fused_attention or not work.score_elements:
            core = work.attention_flops / (p.peak(self.problem.dtype) * scale * (
                self.software.attention_efficiency or p.attention_efficiency))
        else:  # both products over the whole score matrix, then its passes through memory
            peak = p.peak(self.problem.dtype) * scale * p.gemm_fraction(work.score_gemm_flops)
            core = 2 * work.attention_flops / peak + UNFUSED_SCORE_PASSES \
                * work.score_elements * self.problem.element_size / (p.memory_bandwidth * scale)
        return gemm, core, work.elementwise_bytes / (p.memory_bandwidth * scale)

    def layer_seconds(self, layer: int | None, c: Candidate
                      ) -> tuple[float, float, float, float]:
        """(forward, input-gradient backward, weight-gradient backward, communication) seconds
        of one layer for one micro-batch, communication included in the first two."""
        if layer is None:
            return 0.0, 0.0, 0.0, 0.0
        cfg = self.problem.model
        key = (layer, c.tp, c.cp, c.ep, c.etp, c.sp, c.micro_batch, c.recompute,
               c.world_size)
        if key not in self._layers:
            work = layer_work(cfg, layer, self.problem.seq_len, c, self.problem.element_size,
                              self.problem.gemm_dtype in ("fp8", "fp4"))
            gemm, core, memory = self._work_seconds(work, self.rate_scale(c))
            gemms = self._gemm_seconds(work, self.rate_scale(c))
            comm_f, comm_b = layer_communication(self.problem, layer, c, core, self.overlaps,
                                                 gemms)
            forward = gemm + core + memory
            redo = recomputed_seconds(c.recompute, self.software, recomputed_gemm_shares(
                cfg, layer), gemms, core, memory)
            _, dgrad, wgrad = self.gemm_directions(work, self.rate_scale(c))
            backward_input = dgrad + 2.5 * core + 2 * memory + redo
            self._layers[key] = (forward + comm_f, backward_input + comm_b, wgrad,
                                 comm_f + comm_b)
        return self._layers[key]

    # ------------------------------------------------------------------ the pipeline

    def pipeline(self, c: Candidate) -> tuple[PipelinePartition, list[StageShape],
                                              dict[StageShape, int]]:
        """The partition, each stage's shape, and one stage of each distinct shape."""
        key = (c.pp, c.vpp, c.vshape)
        if key not in self._pipelines:
            costs = layer_and_head_cost(self.problem.model, self.problem.seq_len)
            explicit = (list(self.pp_layers) if self.pp_layers
                        and len(self.pp_layers) == c.pp * c.vpp else None)
            part = partition_layers(self.problem.model, c.pp, c.vpp, costs, explicit,
                                    vshape=c.vshape)
            shapes = stage_shapes(self.problem.model, part)
            unique: dict[StageShape, int] = {}
            for stage, shape in enumerate(shapes):
                unique.setdefault(shape, stage)
            self._pipelines[key] = part, shapes, unique
            # per stage, the index of its shape among the distinct ones (hashing a shape for
            # every stage of every candidate would dominate the search)
            order = list(unique)
            self._shape_index[key] = [order.index(shape) for shape in shapes]
        return self._pipelines[key]

    def chunk_costs(self, c: Candidate) -> dict[ChunkShape, ActionCosts]:
        """Costs of every distinct chunk for one micro-batch; the same under every ZeRO stage
        and schedule of one partition, so the search prices them once for those."""
        key = (c.tp, c.cp, c.pp, c.vpp, c.vshape, c.ep, c.etp, c.dp, c.sp, c.micro_batch,
               c.recompute)
        if key not in self._chunks:
            self._chunks[key] = self._price_chunks(c)
        return self._chunks[key]

    def stage_totals(self, c: Candidate) -> tuple[float, float, tuple[float, float]]:
        """(the busiest stage's seconds for one micro-batch, the most communication in them,
        the exposed data-parallel and optimizer seconds after the pipeline): the same for
        every schedule of one split, micro-batch and ZeRO stage, so shared by them (the
        search's first pass asks tens of thousands of times in a large search)."""
        key = (c.tp, c.cp, c.pp, c.vpp, c.vshape, c.ep, c.etp, c.dp, c.sp, c.micro_batch,
               c.recompute, c.zero)
        if key not in self._totals:
            costs = self.chunk_costs(c)
            _, _, unique = self.pipeline(c)
            m = c.microbatches(self.problem.global_batch)
            busy = comm = 0.0
            after = (0.0, 0.0)
            for shape, stage in unique.items():
                work = [costs[k] for k in shape.chunks]
                busy = max(busy, sum(a.total for a in work))
                comm = max(comm, sum(a.communication for a in work))
                last_backward = sum(a.backward + a.weight for a in work)
                first_forward = sum(a.forward for a in work)
                after = max(after, self.data_parallel_seconds(c, stage, last_backward, m,
                                                              first_forward), key=sum)
            self._totals[key] = busy, comm, after
        return self._totals[key]

    def _price_chunks(self, c: Candidate) -> dict[ChunkShape, ActionCosts]:
        pr = self.problem
        _, _, unique = self.pipeline(c)
        groups = layout_groups(c, pr.profile.gpus_per_node)
        hop = (send_seconds(pr.profile, self.stage_message_bytes(c), groups.pp_crosses_nodes)
               if c.pp > 1 else 0.0)
        head = head_work(pr.model, pr.seq_len, c, pr.element_size)
        head_gemm, _, head_memory = self._work_seconds(head, self.rate_scale(c))
        _, head_dgrad, head_wgrad = self.gemm_directions(head, self.rate_scale(c))
        merge = self._work_seconds(mtp_merge_work(pr.model, pr.seq_len, c),
                                   self.rate_scale(c))[0] if pr.model.mtp_depth else 0.0
        dense = self.layer_seconds(self.dense_layer, c)
        moe = self.layer_seconds(self.moe_layer, c)
        (embed_f, embed_b), (head_f, head_b) = edge_communication(self.problem, c, head_gemm,
                                                                  self.overlaps)
        out: dict[ChunkShape, ActionCosts] = {}
        for shape in unique:
            for chunk in shape.chunks:
                if chunk in out:
                    continue
                f, b, w, comm = (chunk.dense * d + chunk.moe * m for d, m in zip(dense, moe))
                merges = max(0, chunk.heads - 1)  # each prediction module's merge
                f += chunk.heads * (head_gemm + head_memory) + merges * merge
                b += chunk.heads * (head_dgrad + 2 * head_memory) + merges * merge
                w += chunk.heads * head_wgrad + merges * merge
                if chunk.heads:
                    f, b = f + chunk.heads * head_f, b + chunk.heads * head_b
                    comm += chunk.heads * (head_f + head_b)
                if not chunk.receives:  # the first virtual stage: the embedding
                    f, b, comm = f + embed_f, b + embed_b, comm + embed_f + embed_b
                if chunk.receives:
                    f, comm = f + hop, comm + hop
                if chunk.sends_back:
                    b, comm = b + hop, comm + hop
                out[chunk] = ActionCosts(f, b, w, comm)
        return out

    def schedule(self, c: Candidate, microbatches: int,
                 order: Sequence[tuple[float, float, float]] | None) -> Schedule:
        """The candidate's schedule with no receives posted ahead, built once for every
        candidate of its pipeline (zb-v's for each order)."""
        key = (c.schedule, c.pp, c.vpp, microbatches, None if order is None else tuple(order))
        if key not in self._schedules:
            self._schedules[key] = build_schedule(c.schedule, c.pp, c.vpp, microbatches,
                                                  receives_ahead=0, costs=order)
        return self._schedules[key]

    def closed_form_seconds(self, c: Candidate, busiest: float, microbatches: int) -> float:
        """The busiest stage's work over one minus the schedule's theoretical bubble: the
        search's first pass (the plan itself uses :meth:`pipeline_seconds`)."""
        busy = busiest * microbatches
        if c.pp == 1:
            return busy
        p, m = c.pp, microbatches
        fraction = {"zb-h1": (p - 1) / (3 * m + p - 1), "zb-v": (p - 1) / (6 * m + p - 1),
                    "interleaved": (p - 1) / (c.vpp * m + p - 1)}.get(c.schedule,
                                                                      (p - 1) / (m + p - 1))
        return busy / (1 - fraction)

    def pipeline_seconds(self, c: Candidate, costs: dict[ChunkShape, ActionCosts],
                         microbatches: int) -> float:
        """The makespan of the step's pipeline in the schedule simulator."""
        _, shapes, _ = self.pipeline(c)
        if c.pp == 1:
            return microbatches * costs[shapes[0].chunks[0]].total
        split = c.schedule in ("zb-h1", "zb-v")

        def price(stage: int, action: Action) -> float:
            a = costs[shapes[stage].chunks[action.chunk]]
            if action.kind == "F":
                return a.forward
            if action.kind == "W":
                return a.weight
            return a.backward if split else a.backward + a.weight

        order = zb_v_order_costs(c, shapes, costs) if c.vshape else None

        def makespan(m: int) -> float:
            rows = self.schedule(c, m, order).timeline(action_cost=price)
            return max(row[-1][1] for row in rows if row)

        step = c.pp  # keeps interleaved's multiple of pp
        m1 = max(c.pp, SIMULATED_MICROBATCHES // step * step)
        if microbatches <= max(SIMULATED_MICROBATCHES, m1 + step):  # the line would end here
            return makespan(microbatches)
        if c.vshape:  # zb-v's list-scheduled order is not periodic (its choices differ from
            # one count to the next): past the start its busiest stage sets the pace
            busiest = max(sum(costs[k].total for k in shape.chunks) for shape in shapes)
            return makespan(m1 + step) + (microbatches - m1 - step) * busiest
        t1, t2 = makespan(m1), makespan(m1 + step)
        return t2 + (microbatches - m1 - step) * (t2 - t1) / step

    # ------------------------------------------------------------------ the whole step

    def data_parallel_costs(self, c: Candidate, stage: int
                            ) -> tuple[tuple[tuple[float, float, float], ...], float]:
        """Per gradient group (dense, experts): (reduction, once-a-step gather (ZeRO 1/2's
        updated chunks; ZeRO-3's amax all-reduce under ``precision.fp8_param_gather``), ZeRO-3
        gather) seconds; and the optimizer step's seconds (memory-bound: every state byte
        read and written once)."""
        key = (c.pp, c.vpp, c.schedule == "zb-v", stage, c.tp, c.cp, c.dp, c.ep, c.etp, c.zero)
        if key not in self._dp:  # (the world size is tp x cp x pp x dp)
            pr = self.problem
            groups = layout_groups(c, pr.profile.gpus_per_node)
            params = self.stage_params(c, stage)
            low = self.stage_low_precision_gather(c, stage)
            per_group = []
            for count, group in zip(rank_params(params, c), (groups.dp, groups.expert_dp)):
                grads, weights = count * pr.reduce_size, count * pr.element_size
                kind = "all_reduce" if c.zero == 0 else "reduce_scatter"
                gather = collective_seconds(pr.profile, "all_gather", group, weights)
                after = gather if c.zero in (1, 2) else 0.0
                if c.zero == 3 and low is not None:  # the first group, the dense one
                    gather = collective_seconds(pr.profile, "all_gather", group, weights
                                                - low.elements * pr.element_size + low.bytes)
                    after = collective_seconds(pr.profile, "all_reduce", group, low.amax_bytes)
                    low = None
                per_group.append((collective_seconds(pr.profile, kind, group, grads), after,
                                  gather if c.zero == 3 else 0.0))
            state = self.stage_state(c, stage)[1]
            bandwidth = pr.profile.memory_bandwidth * self.rate_scale(c)
            self._dp[key] = tuple(per_group), 2 * state / bandwidth
        return self._dp[key]

    def stage_low_precision_gather(self, c: Candidate, stage: int
                                   ) -> LowPrecisionGather | None:
        """The FP8/FP4 part of a rank's ZeRO-3 gather on ``stage`` (None: all in the dtype)."""
        pr = self.problem
        if not pr.gather_formats:
            return None
        held = self.pipeline(c)[0].stage_layers(stage)
        layers = [i for chunk in held.chunks for i in chunk]
        if held.head:
            layers += range(pr.model.num_layers, pr.model.num_layers + pr.model.mtp_depth)
        return low_precision_gather(pr.model, pr.gather_formats, layers, c.tp)

    def data_parallel_seconds(self, c: Candidate, stage: int, last_backward: float,
                              microbatches: int, first_forward: float = 0.0
                              ) -> tuple[float, float]:
        """(exposed reduction and gather seconds, optimizer seconds) of one stage after its
        last backward: ZeRO 0/1 reduce once, overlapping the last backward; ZeRO 2/3 reduce
        every micro-batch's gradients during its own backward; ZeRO 1/2 gather the updated
        chunks after the step (behind the next step's ``first_forward`` where the software
        overlaps that gather); ZeRO-3 gathers in forward and backward, prefetched behind
        compute."""
        per_group, optimizer = self.data_parallel_costs(c, stage)
        times = microbatches if c.zero >= 2 else 1
        hidden = last_backward if self.overlaps else 0.0
        reduce_hidden = hidden if self.software.grad_reduce_overlap else 0.0
        gather_hidden = first_forward if self.overlaps and self.software.param_gather_overlap \
            else 0.0
        exposed = 0.0
        for reduce, gather_after, gather_3 in per_group:
            exposed += times * max(0.0, reduce - reduce_hidden) \
                + max(0.0, gather_after - gather_hidden)
            if gather_3:
                exposed += microbatches * max(0.0, 2 * gather_3 - hidden)
        return exposed, optimizer

    def step_parts(self, c: Candidate, simulate: bool
                   ) -> tuple[float, float, float, tuple[float, float], float]:
        """(pipeline makespan, busiest stage's work and communication per micro-batch, its
        exposed data-parallel and optimizer seconds, the step's seconds)."""
        pr = self.problem
        m = c.microbatches(pr.global_batch)
        busy, comm, after = self.stage_totals(c)
        makespan = (self.pipeline_seconds(c, self.chunk_costs(c), m) if simulate
                    else self.closed_form_seconds(c, busy, m))
        step = (makespan + after[0] + after[1] + pr.profile.step_overhead_s) \
            * pr.profile.time_correction
        return makespan, busy, comm, after, step

    def estimate(self, c: Candidate, simulate: bool = True) -> Estimate:
        """The candidate's step time, memory and throughput; ``simulate=False`` prices the
        pipeline in closed form (the search's first pass, which reads only
        :meth:`step_parts`'s step)."""
        pr = self.problem
        m = c.microbatches(pr.global_batch)
        makespan, busy, comm, (dp_exposed, optimizer), step = self.step_parts(c, simulate)
        memory = self.memory(c, ordered=simulate)
        busy, comm = busy * m, comm * m
        overhead = pr.profile.step_overhead_s
        breakdown = {"compute": busy - comm, "bubble": max(0.0, makespan - busy),
                     "communication": comm + dp_exposed, "optimizer": optimizer,
                     "overhead": overhead}
        fits = memory.peak <= pr.memory_limit
        main = max(("compute", "bubble", "communication"), key=lambda k: breakdown[k])
        bottleneck = "memory" if not fits or breakdown["optimizer"] > breakdown[main] else main
        flops = pr.flops_per_step / step / pr.gpus
        return Estimate(c, step, pr.global_batch * pr.seq_len / step, flops / 1e12,
                        flops / pr.profile.peak(pr.dtype if pr.dtype != "fp64" else "fp32"),
                        memory, fits, bottleneck, breakdown)
