"""The model's own figures of a step, added to its metrics row: MoE routing (load balance,
dropped tokens; the aux-loss-free router bias is updated here, from the step's loads) and the
multi-token-prediction losses. Both reduce over the mesh, so every rank calls them."""

from __future__ import annotations

from meshtron.config import ModelConfig
from meshtron.models.moe import step_routing_stats
from meshtron.training.observers import Observer, StepReport


class MoeRouting(Observer):
    """``moe/*`` figures of the step; a skipped step leaves the router bias as it was."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def on_step(self, report: StepReport) -> None:
        rank = report.rank
        report.row.update(step_routing_stats(
            rank.model.moe_layers(), self.cfg, rank.mesh, rank.plan.tokens_per_step,
            update_bias=not report.out.skipped, device=rank.device))


class MtpLosses(Observer):
    """``model.mtp_depth``: each prediction depth's loss of the step."""

    def on_step(self, report: StepReport) -> None:
        rank = report.rank
        report.row.update(rank.model.mtp_losses.step_metrics(
            rank.mesh, rank.plan.tokens_per_step, rank.device))
