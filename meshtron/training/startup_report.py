"""What the trainer says about a run before its first step: the mesh, the model, its experts,
vision encoder and pipeline, activation memory by formula,
the training state's bytes per parameter, and how FP8 runs here. Each is one line (or none)
computed from the plan and the built model, so it can be read and tested apart from the loop.
"""

from __future__ import annotations

import torch

from meshtron.config import Config, PrecisionConfig
from meshtron.costmodel.activations import activation_bytes_per_layer, formula_covers
from meshtron.models.flops import model_size
from meshtron.models.state_encoder import state_parameters
from meshtron.models.vision import vision_parameters
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.parallel.pipeline.schedules import Schedule
from meshtron.plan import RunPlan
from meshtron.precision.fp8 import scaled_mm_by_default
from meshtron.precision.recipes import formats_said


def run_lines(cfg: Config, plan: RunPlan, padded_vocab: int) -> list[str]:
    """The mesh and batch split, the model, and (where they are) its experts, vision encoder
    and pipeline, a line each."""
    m, p = cfg.model, cfg.parallel
    size = model_size(m)
    unset = plan.schedule is not None and cfg.train.micro_batch is None
    lines = [
        f"mesh: {plan.layout.world_size} ranks, tp={p.tp} cp={p.cp} dp={plan.dp} pp={p.pp}"
        f"{' sp' if p.sp else ''}; micro-batch {plan.micro_batch} x {plan.micro_batches} "
        "accumulation steps"
        + (" (train.micro_batch unset: the largest the pipeline schedule accepts)"
           if unset else ""),
        f"model: {m.preset} ({m.arch}), {size.params / 1e6:.2f}M parameters "
        f"({size.non_embedding_params / 1e6:.2f}M non-embedding), vocab {m.vocab_size} padded "
        f"to {padded_vocab}"
        + (f"; {m.mtp_depth} multi-token-prediction modules ({size.mtp_params / 1e6:.2f}M, "
           f"weight {m.mtp_loss_weight})" if m.mtp_depth else "")]
    if m.is_moe:
        moe = m.moe
        layers = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
        lines.append(f"moe: {moe.num_experts} experts (top-{moe.top_k}, {moe.shared_experts} "
                     f"shared) in {len(layers)} of {m.num_layers} layers, "
                     f"{moe.num_experts // p.ep} per rank (ep={p.ep}); "
                     f"{size.matmul_params / 1e6:.2f}M matmul parameters active per token")
    if m.vision.enabled:
        v = m.vision
        lines.append(
            f"vision: {v.image_size}x{v.image_size} images as {v.num_patches} patches of "
            f"{v.patch_size}, {v.num_layers} encoder blocks of width {v.hidden_size} "
            f"({vision_parameters(v, m.hidden_size, m.vocab_size) / 1e6:.2f}M parameters with the "
            f"projector{' and the readout token' if v.readout_tokens else ''}); "
            + (f"the robot's {v.state_dims}-value state as one token ("
               f"{state_parameters(v, m.hidden_size) / 1e3:.1f}K parameters); "
               if v.state_tokens else "")
            + f"{v.instruction_len} instruction tokens; {v.action_tokens} action "
            f"tokens ({v.action_chunk} x {v.action_dims} dimensions, {v.action_bins} bins) "
            "per observation, the only tokens the loss counts")
    if plan.schedule is not None:
        lines.append(f"pipeline: {p.schedule} over {p.pp} stages with layers "
                     f"{plan.partition.describe()}, {plan.schedule.microbatches} "
                     f"micro-batches; bubble {100 * plan.schedule.theoretical_bubble():.1f}% "
                     f"in theory; receives posted {plan.schedule.receives_ahead} ahead")
    return lines


def activation_line(cfg: Config, blocks: int, schedule: Schedule | None, pp_rank: int,
                    micro_batch: int) -> str | None:
    """The formula's activation bytes on this rank (dense llama blocks): one micro-batch
    through its ``blocks`` layers, or under a pipeline the peak number of micro-batches its
    schedule keeps in flight through one chunk each; under context parallelism this rank's
    seq_len / cp tokens of each sequence. MoE layers keep routing-dependent amounts, so there
    is no formula for them; nor for what zb-h1's deferred weight gradients keep after B
    (measured in tests/test_pipeline.py: its peak exceeds 1F1B's)."""
    p = cfg.parallel
    if not formula_covers(cfg.model):
        return None
    layers, held = blocks, 1
    if schedule is not None:
        layers //= p.vpp
        held = schedule.peak_in_flight()[pp_rank]
    per_mode = {
        mode: held * layers * activation_bytes_per_layer(
            cfg.model, micro_batch, cfg.train.seq_len // p.cp, p.tp, p.sp and p.tp > 1, mode)
        for mode in ("none", "selective", "full")
    }
    others = ", ".join(f"{m} {b / 2**20:.1f}" for m, b in per_mode.items()
                       if m != cfg.train.recompute)
    in_flight = f" x {held} micro-batches in flight" if schedule is not None else ""
    if schedule is not None and schedule.split_backward:
        in_flight += ", more for the inputs and output gradients deferred W steps keep"
    context = f"; {cfg.train.seq_len // p.cp} tokens a sequence (cp={p.cp})" if p.cp > 1 else ""
    return (f"activations: {per_mode[cfg.train.recompute] / 2**20:.1f} MiB per rank in the "
            f"blocks ({layers} layers{in_flight}{context}; recompute={cfg.train.recompute}; "
            f"{others} MiB)")


def state_line(cfg: Config, optimizer: DataParallelOptimizer, local_params: int) -> str:
    """Bytes per parameter this rank keeps between steps, per kind (see precision.md); the
    optimizer's state must exist (``init_state``)."""
    params = max(1, local_params)
    parts = ", ".join(f"{kind} {b / 2**20:.1f} MiB ({b / params:.2f} B/param)"
                      for kind, b in optimizer.memory_bytes().items())
    return f"state per rank ({cfg.precision.dtype}, zero {optimizer.zero_stage}): {parts}"


def fp8_line(pc: PrecisionConfig, device: torch.device) -> str | None:
    """That FP8/FP4 is on, in which blocks, and whether its products are native GEMMs here."""
    if pc.fp8 == "none" and pc.fp4 == "none":
        return None
    e4m3 = torch.float8_e4m3fn
    native = (pc.fp8 in ("tensorwise", "delayed") and pc.fp4 == "none"
              and scaled_mm_by_default(device, e4m3, e4m3, 16, 16, 16))
    if native:
        how = "native FP8 GEMMs (torch._scaled_mm)"
    elif device.type == "cpu":
        how = ("emulated on CPU: the numerics of FP8 (quantised operands, fp32 accumulation), "
               "not its speed")
    else:
        how = ("emulated (dequantised operands multiplied in fp32): no native GEMM wired for "
               "these (MX and NVFP4 ones need a Blackwell GPU)")
    return f"{formats_said(pc)}; {how}"
