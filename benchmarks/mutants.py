"""The planted bugs of benchmarks/mutation.py: one exact replacement each, and its tests.

Each is a bug someone could plausibly write (an off-by-one, a swapped operand, a missing
factor, a forgotten case), none of them one of the seven of issue 46 that escaped the suite.
``tests`` are pytest arguments run inside the mutated copy: the fast tests aimed at that code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str
    """The bug in a few words."""


def m(name: str, area: str, path: str, old: str, new: str, tests: str, what: str) -> Mutant:
    return Mutant(name, area, path, old, new, tuple(tests.split()), what)


MUTANTS = [
    # ------------------------------------------------------------------ mesh
    m("mesh-rank-of-stride", "mesh", "meshtron/parallel/mesh/layout.py",
      "rank += coords.get(axis, 0) * stride", "rank += coords.get(axis, 0) * size",
      "tests/test_mesh.py", "rank_of multiplies by the axis size, not the stride"),
    # ------------------------------------------------------------------ tensor-parallel layers
    m("loss-padded-vocab", "tensor", "meshtron/parallel/tensor/loss.py",
      "start + local_vocab, device=logits.device) >= vocab_size",
      "start + local_vocab, device=logits.device) > vocab_size",
      "tests/test_model.py::test_padded_vocabulary_never_counts_in_the_loss "
      "tests/test_tp_layers.py::test_layers_match_their_unsharded_twins",
      "the first padded vocabulary entry is not masked out of the loss"),
    m("embedding-shard-edge", "tensor", "meshtron/parallel/tensor/layers.py",
      "outside = (local < 0) | (local >= self.weight.shape[0])",
      "outside = (local < 0) | (local > self.weight.shape[0])",
      "tests/test_boundaries.py",
      "a vocab-parallel embedding counts the next shard's first token as its own"),
    # ------------------------------------------------------------------ pipeline schedules
    m("1f1b-warmup", "pipeline", "meshtron/parallel/pipeline/schedules.py",
      "return [_one_f_one_b(forwards, backwards, pp - s - 1) for s in range(pp)]",
      "return [_one_f_one_b(forwards, backwards, pp - s) for s in range(pp)]",
      "tests/test_schedules.py", "1F1B warms up with one forward too many on every stage"),
    m("interleaved-warmup", "pipeline", "meshtron/parallel/pipeline/schedules.py",
      "min((pp - s - 1) * 2 + (vpp - 1) * pp,", "min((pp - s - 1) * 2 + (vpp - 1) * pp + 1,",
      "tests/test_schedules.py", "interleaved 1F1B warms up one forward too many"),
    # ------------------------------------------------------------------ context parallelism
    m("documents-eos", "context", "meshtron/parallel/context/sequence.py",
      "return torch.cumsum(ends, dim=1) - ends", "return torch.cumsum(ends, dim=1)",
      "tests/test_context_parallel.py::test_documents_and_their_positions",
      "an EOS token starts the next document instead of ending its own"),
    m("ring-merge", "context", "meshtron/parallel/context/ring.py",
      "return out * weight + out_b * weight_b, new", "return out * weight + out_b * weight, new",
      "tests/test_context_parallel.py::test_every_cp_algorithm_equals_one_process_attention",
      "the ring's log-sum-exp merge weighs the second block by the first's weight"),
    # ------------------------------------------------------------------ optimizer
    m("lr-warmup", "optimizer", "meshtron/optim/lr_schedule.py",
      "return t.lr * (step + 1) / t.warmup_steps", "return t.lr * step / t.warmup_steps",
      "tests/test_run_outputs.py::test_cosine_decay_after_warm_up",
      "warm-up starts at lr 0 (its first step is wasted)"),
    m("adam-bias-correction", "optimizer", "meshtron/optim/sharded_adamw.py",
      "bias2_sqrt = math.sqrt(1 - t.beta2**self.steps)", "bias2_sqrt = 1 - t.beta2**self.steps",
      "tests/test_sharded_adamw.py",
      "ZeRO/low-precision AdamW forgets the square root of the second bias correction"),
    m("grad-clip-threshold", "optimizer", "meshtron/optim/data_parallel.py",
      "if max_norm > 0 and norm > max_norm:", "if max_norm > 0 and norm > 2 * max_norm:",
      "tests/test_hf_gradients.py::test_three_adamw_steps_give_the_same_weights",
      "gradients are clipped only beyond twice train.grad_clip"),
    m("grad-norm-replicas", "optimizer", "meshtron/optim/grad_buckets.py",
      "+= squares / bucket.replicas", "+= squares",
      "tests/test_tensor_parallel.py::test_tensor_parallel_parity[2]",
      "replicated parameters (norms) counted once per tp rank in the grad norm"),
    # ------------------------------------------------------------------ checkpoint
    m("keep-last", "checkpoint", "meshtron/checkpoint/store.py",
      "for old in complete[:-keep_last]:", "for old in complete[:-keep_last - 1]:",
      "tests/test_checkpoint_store.py::test_keep_last_prunes_old_checkpoints",
      "checkpoint.keep_last keeps one checkpoint more than asked"),
    m("checksum-ignored", "checkpoint", "meshtron/checkpoint/manifest.py",
      "if file_digest(file, expected) != expected:", "if file_digest(file, expected) is None:",
      "tests/test_checkpoint_store.py", "a checkpoint file's checksum is computed, never compared"),
    m("box-intersect", "checkpoint", "meshtron/checkpoint/boxes.py",
      "        if lo >= hi:\n            return None",
      "        if lo > hi:\n            return None",
      "tests/test_checkpoint_store.py tests/test_boundaries.py",
      "boxes that only touch count as overlapping (empty reads)"),
    # ------------------------------------------------------------------ data
    m("blend-ties", "data", "meshtron/data/blend.py",
      "            if lag > best_lag:", "            if lag >= best_lag:",
      "tests/test_data_blend.py tests/test_boundaries.py",
      "the blend breaks ties to the later dataset"),
    m("sampler-epoch", "data", "meshtron/data/sampler.py",
      "key = [self.seed % 2**64, self.stream, epoch]", "key = [self.seed % 2**64, self.stream, 0]",
      "tests/test_data_blend.py", "every epoch repeats the first epoch's order"),
    m("indexed-pointers", "data", "meshtron/data/indexed.py",
      "        pointers *= self.dtype.itemsize\n", "",
      "tests/test_data_indexed.py", "sequence pointers written in tokens, not bytes"),
    m("vla-encode-round", "data", "meshtron/data/vla_tokens.py",
      "np.floor(unit * self.bins)", "np.round(unit * self.bins)",
      "tests/test_vla.py::test_action_tokens_decode_to_their_bin_centres_and_round_trip_within_half_a_bin",
      "actions binned by rounding instead of flooring"),
    # ------------------------------------------------------------------ precision
    m("loss-scale-growth", "precision", "meshtron/precision/policy.py",
      "if self.clean_steps % self.growth_interval == 0:",
      "if self.clean_steps % self.growth_interval == 1:",
      "tests/test_precision.py", "the loss scale grows one clean step after a stretch begins"),
    m("fp8-saturation", "precision", "meshtron/precision/fp8.py",
      "v.clamp(-fmt.max, fmt.max)", "v.clamp(-fmt.max, 2 * fmt.max)",
      "tests/test_fp8.py", "FP8 quantisation saturates positive values at twice the format max"),
    m("fp8-margin", "precision", "meshtron/precision/fp8.py",
      "scale = fmt.max / torch.where(ok, amax, 1.0) / 2.0**margin",
      "scale = fmt.max / torch.where(ok, amax, 1.0) * 2.0**margin",
      "tests/test_fp8.py", "the FP8 scaling margin enlarges the scale instead of shrinking it"),
    m("nvfp4-local-features", "precision", "meshtron/parallel/tensor/linear.py",
      "    if spec is None or spec.dim != 0:\n        return None",
      "    if True:\n        return None",
      "tests/test_low_precision_training.py::test_mxfp8_and_nvfp4_layouts_match_one_process",
      "a tp shard keys NVFP4's stochastic rounding by its local output-feature numbers"),
    m("nvfp4-fp32-products", "precision", "meshtron/precision/nvfp4.py",
      "    return torch.float64 if x.dtype == torch.float64 else torch.float32",
      "    return torch.float32",
      "tests/test_mx_formats.py",
      "an fp64 run's NVFP4 products accumulate in fp32"),
    # ------------------------------------------------------------------ models
    m("rope-exponent", "models", "meshtron/models/rotary.py",
      "exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim",
      "exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / (head_dim - 2)",
      "tests/test_model.py::test_logits_equal_transformers",
      "rotary frequencies spread over head_dim - 2"),
    m("rmsnorm-backward", "models", "meshtron/models/norms.py",
      "dot = (grad_normed * normed).mean(-1, keepdim=True)",
      "dot = (grad_normed * normed).sum(-1, keepdim=True)",
      "tests/test_hf_gradients.py::test_every_gradient_equals_transformers",
      "RMSNorm's hand-written backward sums where it should average"),
    m("moe-topk-normalise", "models", "meshtron/models/moe.py",
      "weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)",
      "weights = weights / scores.sum(-1, keepdim=True).clamp_min(1e-20)",
      "tests/test_moe.py::test_router_scores_groups_and_normalisation",
      "top-k weights normalised by all experts' scores"),
    m("moe-capacity", "models", "meshtron/models/moe.py",
      "keep = position < capacity", "keep = position <= capacity",
      "tests/test_moe.py::test_capacity_drops_the_lowest_weighted_copies",
      "each expert keeps one copy beyond its capacity"),
    m("init-residual-scale", "models", "meshtron/models/init.py",
      "std = std / math.sqrt(2 * num_layers)", "std = std / math.sqrt(num_layers)",
      "tests/test_boundaries.py tests/test_model.py::test_init_is_a_function_of_seed_and_name_only",
      "residual projections scaled by 1/sqrt(L), not 1/sqrt(2L)"),
    # ------------------------------------------------------------------ training
    m("memory-selective", "training", "meshtron/costmodel/activations.py",
      "        attention -= n * heads", "        attention -= n * kv_heads",
      "tests/test_activation_memory.py tests/test_boundaries.py",
      "selective recompute drops the kv heads' log-sum-exp"),
    # ------------------------------------------------------------------ tuning
    m("ring-steps", "tuning", "meshtron/costmodel/comms.py",
      "factor * (n - 1) / n * nbytes / bandwidth", "factor * nbytes / bandwidth",
      "tests/test_boundaries.py tests/test_tp_overlap_cost.py",
      "ring collectives priced as moving the whole buffer per step"),
    m("flops-attention", "tuning", "meshtron/models/flops.py",
      "+ 6.0 * layers * seq_len * scores", "+ 12.0 * layers * seq_len * scores",
      "tests/test_model.py::test_flops_per_token_formula",
      "attention FLOPs counted without the causal half"),
    m("memory-moments", "tuning", "meshtron/costmodel/memory_model.py",
      '"optimizer": 2 * master_bytes * (total if zero == 0 else owned)',
      '"optimizer": master_bytes * (total if zero == 0 else owned)',
      "tests/test_tuner.py", "the cost model counts one Adam moment"),
    # ------------------------------------------------------------------ inference
    m("top-p-boundary", "inference", "meshtron/models/generation.py",
      "before = probs.cumsum(dim=-1) - probs", "before = probs.cumsum(dim=-1)",
      "tests/test_model.py::test_sampling_filters_and_greedy_decoding",
      "nucleus sampling drops the token that crosses top_p"),
    m("top-k-kth", "inference", "meshtron/models/generation.py",
      "values[..., -1:]", "values[..., :1]",
      "tests/test_model.py::test_sampling_filters_and_greedy_decoding tests/test_boundaries.py",
      "top-k keeps only the best token"),
    m("eval-outcome", "envs", "meshtron/envs/tabletop.py",
      'return "table" if block_under(state, *state.gripper) is None else "other_block"',
      'return "other_block" if block_under(state, *state.gripper) is None else "table"',
      "tests/test_vla.py::test_evaluation_counts_only_closing_on_the_named_block_as_success "
      "tests/test_vla_env.py::test_each_ending_is_named",
      "a failed grasp over bare table reported as over another block"),
    # ------------------------------------------------------------------ envs
    m("block-under-axis", "envs", "meshtron/envs/tabletop.py",
      "abs(y - block.y) <= BLOCK_HALF:", "abs(y - block.x) <= BLOCK_HALF:",
      "tests/test_vla_env.py", "a block's extent along y measured from its x"),
]


EQUIVALENT: dict[str, str] = {}
"""Survivors no test can tell apart from the original, by name, with the reason."""
