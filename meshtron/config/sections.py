"""The config schema: one dataclass per section, every field documented where it is declared.

The string under each field is its documentation: ``meshtron train --help`` prints its first
sentence (see :mod:`meshtron.config.docs`), so every field has one.
"""

from __future__ import annotations

import dataclasses
import keyword
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshtron.config.data_section import DataConfig
from meshtron.config.generation_section import GenerationConfig
from meshtron.config.lora_section import LoraConfig
from meshtron.config.rope_section import RopeConfig
from meshtron.config.vision_section import VisionConfig

DTYPES = ("fp32", "bf16", "fp16", "fp64")
REDUCE_DTYPES = ("fp32", "bf16")
FP8_RECIPES = ("none", "tensorwise", "delayed", "blockwise", "mxfp8")
FP4_RECIPES = ("none", "nvfp4")
MX_SCALES = ("rceil", "floor")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
CP_COMMS = ("ring", "all_to_all", "all_gather")
RECOMPUTE = ("none", "selective", "full")
ROUTER_SCORES = ("softmax", "sigmoid")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
ATTENTIONS = ("mha", "mla")
AUX_LOSS_SCOPES = ("micro_batch", "sequence")
EXPERT_COMPUTE = ("grouped", "loop")
AUTOTUNE_MODES = ("off", "watch", "knobs", "layout")


@dataclass
class MoEConfig:
    """Mixture of experts (``model.moe.*``); ``num_experts`` 0 keeps every MLP dense. Unset
    fields (None) come from the preset, then from the defaults in :data:`MOE_DEFAULTS`."""

    num_experts: int | None = None
    """Routed experts per MoE layer; 0 keeps every MLP dense."""
    top_k: int | None = None
    """Experts each token is routed to."""
    expert_ffn_size: int | None = None
    """Hidden units of one expert (fine-grained experts are narrower); None: ffn_hidden_size."""
    shared_experts: int | None = None
    """Always-on experts (DeepSeek), computed as one dense MLP of shared x expert_ffn_size."""
    dense_layers: int | None = None
    """The first this many layers keep a dense MLP."""
    every: int | None = None
    """After the dense layers, every this-many-th layer is MoE (1: all of them)."""
    score: str | None = None
    """Router scores: softmax or sigmoid."""
    normalize_topk: bool | None = None
    """Rescale the chosen experts' weights to sum to one; with top_k=1 the lone weight is then
    exactly 1 (Mixtral), while false keeps its probability (Switch)."""
    route_scale: float | None = None
    """Multiplier of the routing weights."""
    groups: int | None = None
    """Group-limited routing (DeepSeek-V3): experts form this many groups."""
    topk_groups: int | None = None
    """Group-limited routing: each token chooses its experts inside its best this-many
    groups."""
    aux_loss: float | None = None
    """Coefficient of the load-balancing loss (Switch/GShard form); 0 disables."""
    aux_loss_scope: str | None = None
    """Balance over each micro_batch or each sequence."""
    z_loss: float | None = None
    """Coefficient of the router z-loss (mean squared logsumexp of the logits)."""
    bias_update: float | None = None
    """Aux-loss-free balancing: per-expert selection bias moved by this much per step towards
    the mean load (DeepSeek-V3's gamma); 0 disables."""
    capacity_factor: float | None = None
    """Tokens an expert takes per micro-batch, as a multiple of the balanced share; 0: dropless."""
    pad_to_capacity: bool | None = None
    """With a capacity: every expert computes exactly its capacity (padding with zeros)."""
    compute: str | None = None
    """Expert FFNs as one grouped matmul (grouped) or one matmul per expert (loop)."""


MOE_DEFAULTS: dict[str, Any] = dict(
    num_experts=0, top_k=2, shared_experts=0, dense_layers=0, every=1, score="softmax",
    normalize_topk=True, route_scale=1.0, groups=1, topk_groups=1, aux_loss=0.01,
    aux_loss_scope="micro_batch", z_loss=0.0, bias_update=0.0, capacity_factor=0.0,
    pad_to_capacity=False, compute="grouped",
)


@dataclass
class ModelConfig:
    """Model shape. Unset fields (None) come from ``preset``; explicit values win."""

    preset: str = "tiny"
    """A named model shape (see meshtron/config/presets.py); explicit fields override it."""
    arch: str | None = None
    """Architecture: llama (RMSNorm, rotary, SwiGLU), gpt2 (LayerNorm, learned positions) or
    gemma3 (Gemma's (1 + weight) RMSNorms before and after attention and MLP, GELU-gated MLP,
    embeddings scaled by sqrt(hidden_size))."""
    num_layers: int | None = None
    """Transformer blocks."""
    hidden_size: int | None = None
    """Width of the residual stream."""
    num_heads: int | None = None
    """Query heads of attention."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: num_heads."""
    attention: str | None = None
    """Attention: mha (multi-head, grouped-query) or mla (DeepSeek's multi-head latent
    attention: keys and values from one low-rank latent, one rotary key shared by the heads);
    None: the preset's, else mha."""
    q_lora_rank: int | None = None
    """mla: width of the compressed query latent; 0 projects queries from the residual stream
    directly (DeepSeek-V2-Lite)."""
    kv_lora_rank: int | None = None
    """mla: width of the key/value latent, which the KV cache stores with the rotary key."""
    qk_nope_head_dim: int | None = None
    """mla: per-head width of queries and keys without rotary positions."""
    qk_rope_head_dim: int | None = None
    """mla: width of each head's rotary query part and of the rotary key all heads share."""
    v_head_dim: int | None = None
    """mla: per-head width of the values."""
    head_dim: int | None = None
    """Width of one attention head; None: hidden_size / num_heads (Qwen3 and some Mistral
    models set it explicitly, so heads x head_dim may differ from hidden_size)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2); gpt2 always has them."""
    proj_bias: bool = False
    """A bias on attention's output projection (Llama's attention_bias sets it with
    qkv_bias); gpt2 always has it."""
    mlp_bias: bool = False
    """Biases on the dense MLP's projections (Llama's mlp_bias); gpt2 always has them."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before rotary positions (Qwen3)."""
    sliding_window: int | None = None
    """Each token attends to itself and the sliding_window - 1 tokens before it (Mistral);
    None: to every earlier token."""
    sliding_window_pattern: int | None = None
    """With sliding_window: every sliding_window_pattern-th layer (layers pattern - 1,
    2 * pattern - 1, ...) attends to every earlier token and the others through the window
    (Gemma 3: 6, five local layers to one global); None: the window on every layer."""
    rope_local_theta: float | None = None
    """Rotary base of the layers with a sliding window, unscaled (Gemma 3: 10,000), while the
    global layers take rope_theta and model.rope's scaling; None: every layer alike."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scaled by 1 / sqrt(this) instead of 1 / sqrt(head width) (Gemma's
    query_pre_attn_scalar); None: the head width."""
    logit_softcap: float | None = None
    """The final logits soft-capped to cap * tanh(logits / cap) (Gemma's
    final_logit_softcapping); None: not capped."""
    ffn_hidden_size: int | None = None
    """Hidden units of the dense MLP."""
    vocab_size: int | None = None
    """Vocabulary size; None takes the tokenizer's."""
    vocab_multiple: int = 128
    """The embedding is padded to a multiple of this, identically under every layout."""
    max_seq_len: int | None = None
    """Positions the model supports (rotary tables or learned position embeddings)."""
    rope_theta: float | None = None
    """Base of the rotary position frequencies."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary frequency scaling (model.rope.*)."""
    norm_eps: float | None = None
    """Epsilon of the normalisation layers."""
    tie_embeddings: bool | None = None
    """Use the token embedding as the output layer's weight."""
    init_std: float = 0.02
    """Standard deviation of the initial weights (residual outputs scaled by 1/sqrt(2 layers))."""
    mup: bool = False
    """Maximal-update parameterisation (muP, Tensor Programs V): learning rates tuned on a
    narrow proxy transfer to a wide model. With width multiplier m = hidden_size /
    mup_base_width, hidden matrices start with init_std / sqrt(m) and learn at lr / m
    (weight decay x m),
    attention scores are scaled by 1 / (sqrt(head width) * sqrt(m)) and logits by 1 / m;
    embeddings, norms, biases and routers keep init_std and lr. At m = 1 it is the standard
    parameterisation exactly."""
    mup_base_width: int = 256
    """muP: the hidden_size of the proxy the hyper-parameters were tuned on (m = hidden_size /
    this); keep it the same for the proxy and the wide model."""
    dropout: float = 0.0
    """Dropout probability (0, as in modern LLMs, keeps runs layout-independent)."""
    mtp_depth: int | None = None
    """Multi-token prediction (DeepSeek-V3): modules after the decoder predicting the tokens
    2 .. 1 + mtp_depth positions ahead, trained with the model and unused at inference;
    None: the preset's, else 0 (none)."""
    mtp_loss_weight: float = 0.1
    """The weight of the multi-token-prediction loss (the mean over its modules) in the
    objective."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts settings (model.moe.*)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """Vision-language-action settings (model.vision.*); image_size 0: a text model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (model.lora.*); rank 0: none, the whole model trains."""

    @property
    def head_size(self) -> int:
        """The width of one attention head: ``head_dim``, or hidden_size / num_heads."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (``attention=mla``)."""
        return self.attention == "mla"

    @property
    def is_moe(self) -> bool:
        return bool(self.moe.num_experts)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (global index); None: it attends globally."""
        pattern = self.sliding_window_pattern
        if pattern is not None and (layer + 1) % pattern == 0:
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (global index) has experts in place of its MLP."""
        moe = self.moe
        return (self.is_moe and layer >= moe.dense_layers
                and (layer - moe.dense_layers) % moe.every == 0)


@dataclass
class ParallelConfig:
    """How the world is split. dp is derived: world_size / (tp * cp * pp)."""

    tp: int = 1
    """Tensor-parallel ranks (heads, MLP units and vocabulary split over them)."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel ranks: every sequence is split over them in 2·cp load-balanced chunks."""
    cp_comm: str = "ring"
    """How attention sees the whole sequence under cp: ring (keys and values pass around the
    cp ranks), all_to_all (sequence split traded for a head split, DeepSpeed-Ulysses) or
    all_gather (every rank gathers all keys and values, Llama 3)."""
    ep: int = 1
    """Expert-parallel ranks, folded out of the data- and context-parallel ranks."""
    etp: int | None = None
    """Expert tensor parallelism: experts split over tp like the MLP (None: tp), or 1: whole
    experts, each tp rank routing its own share of the tokens (ep then folds over tp too)."""
    vpp: int = 1
    """Model chunks per pipeline stage (interleaved schedule)."""
    sp: bool = False
    """Sequence parallelism: the residual stream between tp regions is split by sequence."""
    tp_comm_overlap: bool = False
    """Under sequence parallelism, overlap the tp all-gathers and reduce-scatters with the
    matrix products beside them, each collective cut into pieces (Megatron's tp-comm-overlap)."""
    tp_comm_chunks: int = 2
    """With parallel.tp_comm_overlap: pieces each rank's sequence share is cut into."""
    zero: int = 0
    """ZeRO stage: 0 replicates optimizer state, 1 shards it over dp, 2 also gradients, 3 also
    parameters."""
    bucket_mb: float = 25.0
    """Gradients are reduced in buckets of about this many MiB, overlapping backward."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved (needs vpp >= 2), zb-h1 or zb-v (needs vpp=2:
    two chunks per stage in a V, stage 0 holding the embedding and the head)."""
    pp_layers: list[int | float] | None = None
    """Layers per virtual pipeline stage (pp * vpp counts in model order); unset: balanced. A
    half (``4.5,3.5``) cuts a layer between its attention and its MLP (needs pp >= 2)."""
    pp_half_layers: bool = False
    """Let the balanced split also cut a layer between its attention and its MLP (stages
    balanced to half a layer, for few layers per stage beside a large output layer)."""
    zb_v_measured_order: int = 0
    """zb-v: after this many steps (>= 2), re-order for each chunk's measured F, B and W
    seconds (steps 2 on, shared by all ranks); 0: the order made for the split's FLOPs. Other
    schedules ignore it."""
    receives_ahead: int | None = None
    """Pipeline receives posted this many messages before their consumer, so hand-overs happen
    while the stage computes (each one more message buffer per stream); unset: what the
    schedule needs (1; interleaved 2-3, about pp / 3 past pp = 8); 0: right before the
    consumer."""


@dataclass
class TrainConfig:
    """The optimisation: steps, batch, learning-rate schedule, AdamW, evaluation."""

    steps: int = 200
    """Optimizer steps of the whole run."""
    global_batch: int = 8
    """Sequences per optimizer step, summed over micro-batches and data-parallel ranks."""
    micro_batch: int | None = None
    """Sequences per forward pass per rank; None means global_batch / dp (no accumulation)."""
    seq_len: int = 256
    """Tokens per training sequence."""
    lr: float = 3e-3
    """Peak learning rate, reached after the warm-up."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seed of the initial weights and of the data order (both layout-free)."""
    log_every: int = 10
    """Log and write a metrics row every this many steps."""
    eval_every: int = 100
    """Evaluate on the validation split every this many steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Global batches of the validation split per evaluation."""
    eval_generate: int = 0
    """Tokens sampled greedily at each evaluation from the first 16 tokens of two validation
    sequences, logged and written to TensorBoard as text; 0: none."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention cores) or full (whole layers)."""
    compile: bool = False
    """torch.compile each transformer block (TorchTitan's granularity); the first step then
    includes the compile, logged as such."""
    max_skipped: int = 10
    """A step whose loss or gradient norm is NaN/inf on any rank is skipped on every rank
    (weights and optimizer state untouched, counted as skipped_steps); this many in a row stop
    the run with one line."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; None looks it up (GPUs) or measures it (CPU)."""
    autotune: str = "off"
    """Online re-tuning: off; watch (every autotune_every steps set the measured step time
    against the cost model's prediction and, on a sustained drift, name the cause: a slow
    rank, memory pressure, exposed communication); knobs (watch, then try the micro-batch
    sizes that keep the global batch and keep the fastest measured; the numbers do not
    change); layout (knobs, and at the first window a layout the cost model predicts clearly
    faster: checkpoint, restart into it through the launcher, resharded; needs
    autotune_profile)."""
    autotune_every: int = 10
    """Steps per re-tuning window (one all-gather of three numbers per rank)."""
    autotune_drift: float = 0.25
    """Growth of the measured/predicted step-time ratio, over its value at the first window,
    that counts as drift (two windows in a row)."""
    autotune_profile: str | None = None
    """The cluster profile that prices the plan (a GPU name such as h100-sxm, or a profile
    .json of ``meshtron tune --calibrate``); None: the yardstick is the measured step time."""


@dataclass
class PrecisionConfig:
    """Number formats of parameters, activations, gradients and the FP8 recipe."""

    dtype: str = "fp32"
    """Parameters and activations: fp32, bf16/fp16 with fp32 master weights, or fp64 for
    verification runs. On a CPU without 16-bit matrix instructions bf16/fp16 are many times
    slower than fp32 (said at start-up)."""
    reduce_dtype: str = "fp32"
    """Gradient buckets and their data-parallel reduction: fp32, or bf16 (half the bytes)."""
    loss_scaling: bool = True
    """Dynamic loss scaling under fp16 (an overflow without it stops training)."""
    fp8: str = "none"
    """FP8 for the blocks' linear layers: none, tensorwise, delayed or blockwise scaling, or
    mxfp8 (OCP microscaling: a power-of-two scale per 32 elements along each product's
    reduction dimension; see docs/precision.md)."""
    fp8_grad: str = "e5m2"
    """FP8 format of output gradients: e5m2 or e4m3 (activations and weights are e4m3)."""
    mx_scale: str = "rceil"
    """MXFP8 block scales: rceil (rounded up so the block's amax fits, as cuBLAS and torchao
    train) or floor (the OCP spec's rule; the largest values may saturate)."""
    fp4: str = "none"
    """FP4 for the blocks' linear layers: none or nvfp4 (E2M1 values, an E4M3 scale per 16
    and one per tensor; 16x16 weight blocks, Hadamard-transformed weight-gradient inputs,
    stochastically rounded gradients). Blocks not in fp4_layers use precision.fp8."""
    fp4_layers: list[int] | None = None
    """Blocks in NVFP4 (negative indices count from the end); None: every block not kept."""
    keep_layers: list[int] | None = None
    """Blocks kept in precision.dtype whatever fp8/fp4 say (negative indices count from the
    end; Megatron-Core keeps the first and the last: 0,-1). The output layer always is."""
    fp4_hadamard: bool = True
    """NVFP4: random Hadamard transform of the weight-gradient product's inputs."""
    fp4_stochastic: bool = True
    """NVFP4: round output gradients stochastically (else to nearest)."""
    fp8_block: int = 128
    """Block size of blockwise scaling (1 x block activation tiles, block x block weights)."""
    fp8_history: int = 1024
    """Delayed scaling: steps of amax history."""
    fp8_amax: str = "max"
    """Delayed scaling: the scale comes from the history's max or its most_recent amax."""
    fp8_param_gather: bool = False
    """ZeRO-3 gathers the FP8 blocks' linear weights in E4M3 (1 byte an element, one
    power-of-two scale per weight) and the NVFP4 blocks' in E2M1 (half a byte, at the whole
    weight's scales) instead of precision.dtype; every layout computes with the same weights
    (FP8: that round trip; NVFP4: its one quantisation), so one process matches."""


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written, and whether a run resumes from them."""

    dir: str | None = None
    """Where checkpoints go; None means <run.dir>/checkpoints."""
    every: int = 500
    """Save every this many steps (and at the end); 0 saves only at the end."""
    every_seconds: float = 0.0
    """Also save when this many seconds have passed since the last save (0: off): bounds the
    work a crash or restart loses whatever the step time (rank 0's clock decides for all)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after each save."""
    resume: bool = True
    """Resume from the newest complete checkpoint in checkpoint.dir when there is one."""
    resume_from: str | None = None
    """Resume from this step of checkpoint.dir (a number) or this checkpoint directory instead
    of the newest; later checkpoints and metric rows are set aside as abandoned-* and
    metrics.replaced.jsonl."""
    on_corrupt: str = "error"
    """When the newest checkpoint is complete but unusable (damaged, edited, unreadable):
    ``error`` stops with one line naming it; ``previous`` verifies every file and falls back
    to the newest checkpoint that passes, saying which were skipped. A ``.tmp-*`` directory
    (an interrupted save) is always skipped with a warning."""
    async_: bool = False
    """Copy the state to host memory and write it while training goes on (at most one save
    in flight; a failed save is reported at the next step). Set as ``checkpoint.async``."""


@dataclass
class RunConfig:
    """The run directory and how the run reports."""

    dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, TensorBoard events, loss.png."""
    progress: bool = True
    """Show a live progress bar on stderr."""
    plot: bool = True
    """Write loss.png into the run directory at the end."""
    timeout_s: float = 600.0
    """How long a rank waits in a collective before giving up (a peer died or hangs)."""
    straggler_every: int = 20
    """Every this many steps, gather each rank's compute time and name the ranks slower than
    straggler_factor x the median (a log line and a metrics.jsonl event); 0 turns it off."""
    straggler_factor: float = 1.5
    """How many times the median compute time makes a rank a straggler."""
    wandb: str = "off"
    """Weights & Biases logging beside TensorBoard: off, offline (written under
    <run.dir>/wandb, no network; `wandb sync` uploads later) or online. Needs the wandb
    package (pip install 'meshtron[wandb]')."""
    wandb_project: str = "meshtron"
    """The Weights & Biases project of the run (named after run.dir)."""


@dataclass
class Config:
    """A whole run's settings, one attribute per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {section: {config_key(k): v for k, v in values.items()}
                for section, values in dataclasses.asdict(self).items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.run.dir) / "checkpoints")


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def config_key(attr: str) -> str:
    """A field's name in YAML and overrides (``async_`` is ``async``: Python keywords cannot
    be attribute names)."""
    return attr[:-1] if attr.endswith("_") and keyword.iskeyword(attr[:-1]) else attr


def attribute_name(key: str) -> str:
    """Inverse of :func:`config_key`."""
    return f"{key}_" if keyword.iskeyword(key) else key
