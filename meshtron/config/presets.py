"""Named model shapes.

``tiny`` (its mixture-of-experts twin ``tiny-moe``, ``tiny-long`` with 16K positions for
context parallelism, ``tiny-mla`` with latent attention and ``tiny-deepseek`` with latent
attention, DeepSeek-V3's routing and multi-token prediction) trains in seconds on a CPU, as does
``tiny-vla``, a vision-language-action policy (:mod:`meshtron.models.vision`); ``small``
is a ~125M model; the rest are the published shapes of large models (dense and MoE), used for
planning (parameter counts, FLOPs, the tuner) and never built on a CPU: ``llama3-*`` at Llama 3's
8,192 positions, ``llama3.1-*`` at Llama 3.1's 131,072 with its rotary scaling. A preset leaves
``vocab_size`` unset when the model should take its tokenizer's size.
"""

from typing import Any

LLAMA31_ROPE: dict[str, Any] = dict(scaling="llama3", factor=8.0, original_max_len=8192,
                                    low_freq_factor=1.0, high_freq_factor=4.0)
"""Llama 3.1's rotary scaling (``model.rope``), shared by its three sizes (copied into each)."""

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        arch="llama", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
        ffn_hidden_size=768, max_seq_len=1024, tie_embeddings=False,
    ),
    "tiny-long": dict(  # tiny at long context: trains with parallel.cp on a CPU
        arch="llama", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
        ffn_hidden_size=768, max_seq_len=16384, tie_embeddings=False,
    ),
    "tiny-moe": dict(
        arch="llama", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
        ffn_hidden_size=768, max_seq_len=1024, tie_embeddings=False,
        moe=dict(num_experts=8, top_k=2, expert_ffn_size=192, shared_experts=1),
    ),
    "tiny-mla": dict(  # tiny with DeepSeek's multi-head latent attention
        arch="llama", num_layers=4, hidden_size=256, num_heads=8, attention="mla",
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, ffn_hidden_size=768, max_seq_len=1024, tie_embeddings=False,
    ),
    "tiny-deepseek": dict(  # DeepSeek-V3 scaled down: latent attention, its routing, MTP
        arch="llama", num_layers=4, hidden_size=256, num_heads=8, attention="mla",
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, ffn_hidden_size=768, max_seq_len=1024, tie_embeddings=False,
        mtp_depth=1,
        moe=dict(num_experts=8, top_k=2, expert_ffn_size=128, shared_experts=1, dense_layers=1,
                 score="sigmoid", normalize_topk=True, route_scale=2.5, groups=4,
                 topk_groups=2, aux_loss=0.0001, aux_loss_scope="sequence",
                 bias_update=0.001),
    ),
    "tiny-vla": dict(  # a vision-language-action policy: ViT patches + instruction -> actions
        arch="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=4,
        ffn_hidden_size=384, max_seq_len=128, tie_embeddings=False,
        vision=dict(image_size=32, patch_size=8, hidden_size=128, num_layers=2, num_heads=4,
                    ffn_hidden_size=512, action_dims=3, action_bins=256, action_chunk=1,
                    instruction_len=11),
    ),
    "small": dict(
        arch="llama", num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=12,
        ffn_hidden_size=2048, vocab_size=32000, max_seq_len=2048, tie_embeddings=False,
    ),
    "gpt2-small": dict(
        arch="gpt2", num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=12,
        ffn_hidden_size=3072, vocab_size=50257, max_seq_len=1024, tie_embeddings=True,
    ),
    "llama3.2-1b": dict(
        arch="llama", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=8192, vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama3-8b": dict(
        arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=14336, vocab_size=128256, max_seq_len=8192, rope_theta=500000.0,
        tie_embeddings=False,
    ),
    "llama3-70b": dict(
        arch="llama", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        ffn_hidden_size=28672, vocab_size=128256, max_seq_len=8192, rope_theta=500000.0,
        tie_embeddings=False,
    ),
    "llama3-405b": dict(
        arch="llama", num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
        ffn_hidden_size=53248, vocab_size=128256, max_seq_len=8192, rope_theta=500000.0,
        tie_embeddings=False,
    ),
    # Llama 3.1: the Llama 3 shapes trained on to 128K positions, with the published rotary
    # scaling (llama3 type: factor 8 over the original 8,192 positions, low/high frequency
    # factors 1 and 4), as their config.json files give it
    "llama3.1-8b": dict(
        arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=14336, vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
        tie_embeddings=False, rope=dict(LLAMA31_ROPE),
    ),
    "llama3.1-70b": dict(
        arch="llama", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        ffn_hidden_size=28672, vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
        tie_embeddings=False, rope=dict(LLAMA31_ROPE),
    ),
    "llama3.1-405b": dict(
        arch="llama", num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
        ffn_hidden_size=53248, vocab_size=128256, max_seq_len=131072, rope_theta=500000.0,
        tie_embeddings=False, rope=dict(LLAMA31_ROPE),
    ),
    "mixtral-8x7b": dict(
        arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
        ffn_hidden_size=14336, vocab_size=32000, max_seq_len=32768, rope_theta=1e6,
        tie_embeddings=False,
        moe=dict(num_experts=8, top_k=2, score="softmax", normalize_topk=True, aux_loss=0.02),
    ),
    # the published shape with multi-head latent attention and one multi-token-prediction
    # module: 671B parameters, 37B active per token, and the module's 14B
    "deepseek-v3": dict(
        arch="llama", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=128,
        attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, norm_eps=1e-6, mtp_depth=1,
        ffn_hidden_size=18432, vocab_size=129280, max_seq_len=163840, tie_embeddings=False,
        moe=dict(num_experts=256, top_k=8, expert_ffn_size=2048, shared_experts=1,
                 dense_layers=3, score="sigmoid", normalize_topk=True, route_scale=2.5,
                 groups=8, topk_groups=4, aux_loss=0.0001, aux_loss_scope="sequence",
                 bias_update=0.001),
    ),
    "gpt3-175b": dict(
        arch="gpt2", num_layers=96, hidden_size=12288, num_heads=96, num_kv_heads=96,
        ffn_hidden_size=49152, vocab_size=50257, max_seq_len=2048, tie_embeddings=True,
    ),
    # a planning shape at the scale the tuner must reach: 10 trillion parameters in 1024
    # fine-grained experts per layer (top-8 and one shared, DeepSeek-style), 96 layers,
    # grouped-query attention; about 125B parameters active per token
    "moe-10t": dict(
        arch="llama", num_layers=96, hidden_size=12288, num_heads=96, num_kv_heads=8,
        ffn_hidden_size=49152, vocab_size=131072, max_seq_len=8192, rope_theta=500000.0,
        tie_embeddings=False,
        moe=dict(num_experts=1024, top_k=8, expert_ffn_size=2816, shared_experts=1,
                 dense_layers=1, score="sigmoid", normalize_topk=True, aux_loss=0.0001),
    ),
}
