"""The pipeline executor: runs one stage's actions of any :class:`Schedule`.

Activations and their gradients travel between stages with non-blocking point-to-point
messages, each direction between two stages over a group of its own
(``ParallelMesh.pp_sends`` / ``pp_receives``: NCCL orders one group's operations on one
stream, so a shared group could queue a send behind a receive and deadlock). A send is started
as soon as its tensor exists and waited for as soon as the schedule shows it complete
(:mod:`.completions`), else at the end of the step; a receive is posted where the schedule says
and waited for just before the action that consumes it. Every message carries a tag naming
(direction, micro-batch, receiving virtual stage), and the schedule posts receives in the order
the peer sends, so matching is unambiguous for transports that match by tag (gloo) or by order
(NCCL). Where consecutive virtual stages sit on the same stage (the turn of zb-v's V) the
activation and its gradient are handed over in memory, detached as if sent.

Gradient reduction over data-parallel ranks is driven the same way as without a pipeline: each
action that produces weight gradients (B, and W under a split backward) is one "micro-batch" of
the gradient synchronisation (:class:`GradientSync`, which the data-parallel optimizer
provides), and the last of them on this stage is the one that communicates (every one under
ZeRO-2/3).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from meshtron.parallel.context.sequence import MicroBatch
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.pipeline.completions import send_completions
from meshtron.parallel.pipeline.partition import PipelinePartition, placement_of
from meshtron.parallel.pipeline.schedules import Action, Schedule
from meshtron.parallel.tensor.weight_grad import WeightGradStore

_DIRECTIONS = {"F": 0, "B": 1}


class GradientSync(Protocol):
    """What the executor asks of whoever reduces the gradients its actions produce."""

    def begin_micro_batch(self, last: bool) -> None:
        """A gradient-producing action starts; ``last``: the step's last one on this stage."""

    def end_micro_batch(self) -> None:
        """That action's gradients are complete."""

    def hold_shared_parameters(self) -> None:
        """Keep parameters used by every micro-batch available for the whole step (ZeRO-3's
        embedding and head, as micro-batches interleave)."""


class PipelineExecutor:
    """Runs ``schedule``'s actions for this rank's stage on ``model`` (built for ``partition``,
    with ``split_weight_grads`` when the schedule splits the backward)."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, partition: PipelinePartition,
                 schedule: Schedule, hidden_size: int):
        self.model = model
        self.mesh = mesh
        self.partition = partition
        self.stage = mesh.pp.rank
        """This rank's pipeline stage."""
        self.hidden_size = hidden_size
        self.store: WeightGradStore | None = model.grad_store
        self.use(schedule)
        self.trace: list[tuple[Action, float, float]] | None = None
        """When a list: (action, start, end) of each compute action, ``perf_counter`` seconds
        (waiting for its input included in neither: a receive is waited for before start; on a
        GPU the device's queue is drained at both ends, so an action's kernels are timed)."""

    def use(self, schedule: Schedule) -> None:
        """Run ``schedule`` from the next step on (the same placement of chunks; zb-v's order
        rebuilt for measured costs, :mod:`.measured_order`)."""
        assert (self.store is not None) == schedule.split_backward, (
            "a zero-bubble schedule needs a model built with split_weight_grads, and only it")
        assert self.partition.vshape == schedule.vshape, (
            "the partition and the schedule place chunks alike")
        self.schedule = schedule
        self.actions = schedule.stages[self.stage]
        self.completions = send_completions(schedule)[self.stage]
        grad_actions = [i for i, a in enumerate(self.actions) if a.kind in ("B", "W")]
        self.last_grad_action = grad_actions[-1] if grad_actions else -1

    # ------------------------------------------------------------------ messages

    def _tag(self, direction: str, microbatch: int, virtual_stage: int) -> int:
        per_direction = self.schedule.microbatches * self.partition.virtual_stages
        return (_DIRECTIONS[direction] * per_direction
                + microbatch * self.partition.virtual_stages + virtual_stage)

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Start sending to stage ``peer`` over the group of this direction alone."""
        tensor = tensor.detach().contiguous()
        self.mesh.stats.record(self.mesh.pp.name, "send", tensor.numel() * tensor.element_size())
        return dist.isend(tensor, dst=self.mesh.pp.ranks[peer], group=self.mesh.pp_sends[peer],
                          tag=tag)

    def _post_receive(self, shape: torch.Size, dtype: torch.dtype, peer: int,
                      tag: int) -> tuple[dist.Work, torch.Tensor]:
        """Post a receive from stage ``peer`` over the group of that direction alone."""
        buffer = torch.empty(shape, dtype=dtype, device=self._device())
        work = dist.irecv(buffer, src=self.mesh.pp.ranks[peer],
                          group=self.mesh.pp_receives[peer], tag=tag)
        return work, buffer

    def _local_chunk(self, virtual_stage: int) -> int | None:
        """This stage's chunk that runs ``virtual_stage``, or None if another stage does."""
        stage, chunk = placement_of(self.partition.pp, virtual_stage, self.partition.vshape)
        return chunk if stage == self.stage else None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _now(self) -> float:
        """``perf_counter``; while tracing on a GPU, after the device's queued work (else an
        action's kernel launches would be timed, not the kernels)."""
        if self.trace is not None and (device := self._device()).type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _hidden_shape(self, micro_batch: MicroBatch) -> torch.Size:
        batch, seq = micro_batch.tokens.shape
        region = self.model.region
        if region.sequence_parallel:
            seq //= region.size
        return torch.Size((batch, seq, self.hidden_size))

    # ------------------------------------------------------------------ training step

    def train(self, micro_batches: list[MicroBatch], optimizer: GradientSync, *,
              loss_weight: float) -> torch.Tensor:
        """Forward and backward of every micro-batch through this stage; returns the sum of
        token losses (non-zero on the last stage only). ``loss_weight`` multiplies each
        micro-batch's loss before backward (loss scale / global token count)."""
        partition, model = self.partition, self.model
        optimizer.hold_shared_parameters()
        dtype = next(model.parameters()).dtype
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._device())
        receives: dict[tuple[str, int, int], tuple[dist.Work, torch.Tensor]] = {}
        stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        input_grads: dict[tuple[int, int], torch.Tensor] = {}
        deferred: dict[tuple[int, int], list] = {}
        sends: dict[int, dist.Work] = {}
        last_virtual = partition.virtual_stages - 1

        for index, action in enumerate(self.actions):
            m, c = action.microbatch, action.chunk
            vstage = partition.virtual_stage(self.stage, c)
            kind = action.kind
            started = None
            if kind == "RECV_F":
                receives["F", m, c] = self._post_receive(
                    self._hidden_shape(micro_batches[m]), dtype, action.peer,
                    self._tag("F", m, vstage))
            elif kind == "RECV_B":
                receives["B", m, c] = self._post_receive(
                    self._hidden_shape(micro_batches[m]), dtype, action.peer,
                    self._tag("B", m, vstage))
            elif kind == "F":
                if vstage == 0:
                    x = micro_batches[m].tokens
                elif (before := self._local_chunk(vstage - 1)) is not None:
                    x = stash[m, before][1].detach().requires_grad_(True)
                else:
                    work, x = receives.pop(("F", m, c))
                    work.wait()
                    x.requires_grad_(True)
                started = self._now()
                out = model(x, chunk=c, sequence=micro_batches[m].sequence,
                            ahead=micro_batches[m].ahead, inputs=micro_batches[m].inputs)
                if vstage == last_virtual:
                    loss = model.loss_sum(out, micro_batches[m].targets)
                    loss_sum += loss.detach().double()
                    out = loss * loss_weight
                elif out.dtype != dtype:
                    out = out.to(dtype)
                stash[m, c] = (x, out)
            elif kind == "SEND_F":
                sends[index] = self._send(stash[m, c][1], action.peer,
                                          self._tag("F", m, vstage + 1))
            elif kind == "B":
                x, out = stash.pop((m, c))
                grad = None
                if vstage != last_virtual:
                    if (after := self._local_chunk(vstage + 1)) is not None:
                        grad = input_grads.pop((m, after))
                    else:
                        work, grad = receives.pop(("B", m, c))
                        work.wait()
                started = self._now()
                optimizer.begin_micro_batch(last=index == self.last_grad_action)
                if self.store is not None:
                    self.store.deferring = True
                torch.autograd.backward(out, grad)
                del out, grad  # release this micro-batch's graph now, not at the next action
                if self.store is not None:
                    self.store.deferring = False
                    deferred[m, c] = self.store.take()
                optimizer.end_micro_batch()
                if vstage > 0:
                    input_grads[m, c] = x.grad
            elif kind == "SEND_B":
                sends[index] = self._send(input_grads.pop((m, c)), action.peer,
                                          self._tag("B", m, vstage - 1))
            elif kind == "W":
                started = self._now()
                optimizer.begin_micro_batch(last=index == self.last_grad_action)
                WeightGradStore.run(deferred.pop((m, c)))
                optimizer.end_micro_batch()
            else:
                raise ValueError(f"unknown pipeline action {action}")
            if started is not None and self.trace is not None:
                self.trace.append((action, started, self._now()))
            for send in self.completions.get(index, ()):
                sends.pop(send).wait()  # complete by now: lets its tensor go
        for work in sends.values():
            work.wait()
        assert not (receives or stash or input_grads or deferred), "schedule left work undone"
        return loss_sum

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Sum of token losses of forward passes only (non-zero on the last stage only):
        micro-batch by micro-batch, each through the virtual stages in order."""
        partition, model = self.partition, self.model
        dtype = next(model.parameters()).dtype
        total = torch.zeros((), dtype=torch.float64, device=self._device())
        sends: list[dist.Work] = []
        for m, micro_batch in enumerate(micro_batches):
            out = micro_batch.tokens
            for c in range(partition.vpp):
                vstage = partition.virtual_stage(self.stage, c)
                if vstage == 0 or self._local_chunk(vstage - 1) is not None:
                    x = out
                else:
                    source = placement_of(partition.pp, vstage - 1, partition.vshape)[0]
                    work, x = self._post_receive(self._hidden_shape(micro_batch), dtype, source,
                                                 self._tag("F", m, vstage))
                    work.wait()
                out = model(x, chunk=c, sequence=micro_batch.sequence, inputs=micro_batch.inputs)
                if vstage == partition.virtual_stages - 1:
                    total += model.loss_sum(out, micro_batch.targets).double()
                elif self._local_chunk(vstage + 1) is None:
                    target = placement_of(partition.pp, vstage + 1, partition.vshape)[0]
                    sends.append(self._send(out.to(dtype), target, self._tag("F", m, vstage + 1)))
                else:
                    out = out.to(dtype)
        for work in sends:
            work.wait()
        return total
