"""Name and layout mapping between meshtron's global parameters and Hugging Face models.

Pure tensor maps (no ``transformers`` import): ``to_hf`` turns a full meshtron state dict into
the keys of ``LlamaForCausalLM`` / ``MixtralForCausalLM`` (llama with experts) /
``GPT2LMHeadModel``; ``from_hf`` goes back. Fused meshtron projections are split (kv -> k/v,
gate_up -> gate/up, an expert's gate_up -> w1/w3); GPT-2's fused c_attn is split into q and kv;
GPT-2's Conv1D weights are stored transposed. The router's selection bias (aux-loss-free
balancing) has no HF counterpart: ``to_hf`` leaves it out, ``from_hf`` fills zeros. The padded
vocabulary rows are kept, so the HF model's vocab is the padded size.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtron.config import ModelConfig
from meshtron.models.transformer import padded_vocab_size

Tensors = dict[str, torch.Tensor]
GPT2_LINEARS = (("attn.proj", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj"))


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Arguments for ``transformers.LlamaConfig``, ``MixtralConfig`` (a llama model with
    experts) or ``GPT2Config`` matching ``cfg``. Whether HF Mixtral can express the MoE
    settings is checked by the caller (``hf_convert``)."""
    vocab = padded_vocab_size(cfg)
    if cfg.arch == "llama":
        common = dict(
            vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        )
        if cfg.is_moe:
            moe = cfg.moe
            return dict(
                **common, intermediate_size=moe.expert_ffn_size,
                num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                router_aux_loss_coef=moe.aux_loss, router_jitter_noise=0.0, sliding_window=None,
            )
        return dict(**common, intermediate_size=cfg.ffn_hidden_size, attention_bias=False,
                    mlp_bias=False)
    return dict(
        vocab_size=vocab, n_embd=cfg.hidden_size, n_inner=cfg.ffn_hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_heads, n_positions=cfg.max_seq_len,
        layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new",
        tie_word_embeddings=cfg.tie_embeddings, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def _split_c_attn(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-2's Conv1D c_attn (stored [in, q|k|v]) -> our q and kv (stored [out, in])."""
    q, kv = fused.t().split([cfg.hidden_size, 2 * cfg.hidden_size], dim=0)
    return q, kv


def _experts_to_hf(state: Tensors, src: str, dst: str, num_experts: int) -> Tensors:
    """One MoE layer: our ``src`` (``layers.i.mlp.``) -> HF ``dst``
    (``model.layers.i.block_sparse_moe.``); the selection bias is left out."""
    out = {dst + "gate.weight": state[src + "router.weight"]}
    for j in range(num_experts):
        gate, up = state[f"{src}experts.{j}.gate_up.weight"].chunk(2)
        out[f"{dst}experts.{j}.w1.weight"] = gate
        out[f"{dst}experts.{j}.w3.weight"] = up
        out[f"{dst}experts.{j}.w2.weight"] = state[f"{src}experts.{j}.down.weight"]
    return out


def _experts_from_hf(hf: Tensors, src: str, dst: str, num_experts: int) -> Tensors:
    """Inverse of :func:`_experts_to_hf`; the selection bias starts at zero (fp32)."""
    router = hf[src + "gate.weight"]
    out = {dst + "router.weight": router,
           dst + "router.expert_bias": torch.zeros(num_experts, device=router.device)}
    for j in range(num_experts):
        out[f"{dst}experts.{j}.gate_up.weight"] = torch.cat(
            [hf[f"{src}experts.{j}.w1.weight"], hf[f"{src}experts.{j}.w3.weight"]])
        out[f"{dst}experts.{j}.down.weight"] = hf[f"{src}experts.{j}.w2.weight"]
    return out


def to_hf(state: Tensors, cfg: ModelConfig) -> Tensors:
    """A full meshtron state dict (global names) -> the HF model's state dict."""
    out: Tensors = {}
    llama = cfg.arch == "llama"
    for i in range(cfg.num_layers):
        src = f"layers.{i}."
        if llama:
            dst = f"model.layers.{i}."
            q = state[src + "attn.q.weight"]
            k, v = state[src + "attn.kv.weight"].chunk(2)
            out.update({
                dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": state[src + "attn.proj.weight"],
                dst + "input_layernorm.weight": state[src + "attn_norm.weight"],
                dst + "post_attention_layernorm.weight": state[src + "mlp_norm.weight"],
            })
            if cfg.is_moe_layer(i):
                out.update(_experts_to_hf(state, src + "mlp.", dst + "block_sparse_moe.",
                                          cfg.moe.num_experts))
            else:
                gate, up = state[src + "mlp.gate_up.weight"].chunk(2)
                out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                            dst + "mlp.down_proj.weight": state[src + "mlp.down.weight"]})
        else:
            dst = f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[dst + theirs + ".weight"] = state[src + ours + ".weight"]
                out[dst + theirs + ".bias"] = state[src + ours + ".bias"]
            for part in ("weight", "bias"):
                out[dst + "attn.c_attn." + part] = torch.cat(
                    [state[src + "attn.q." + part], state[src + "attn.kv." + part]]).t()
            for ours, theirs in GPT2_LINEARS:
                out[dst + theirs + ".weight"] = state[src + ours + ".weight"].t()
                out[dst + theirs + ".bias"] = state[src + ours + ".bias"]
    output = state["embed.weight"] if cfg.tie_embeddings else state["output.weight"]
    if llama:
        out["model.embed_tokens.weight"] = state["embed.weight"]
        out["model.norm.weight"] = state["final_norm.weight"]
    else:
        out["transformer.wte.weight"] = state["embed.weight"]
        out["transformer.wpe.weight"] = state["pos_embed.weight"]
        out["transformer.ln_f.weight"] = state["final_norm.weight"]
        out["transformer.ln_f.bias"] = state["final_norm.bias"]
    out["lm_head.weight"] = output
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: Tensors, cfg: ModelConfig) -> Tensors:
    """Inverse of :func:`to_hf` (an HF state dict -> meshtron global names)."""
    out: Tensors = {}
    llama = cfg.arch == "llama"
    for i in range(cfg.num_layers):
        dst = f"layers.{i}."
        if llama:
            src = f"model.layers.{i}."
            out[dst + "attn.q.weight"] = hf[src + "self_attn.q_proj.weight"]
            out[dst + "attn.kv.weight"] = torch.cat(
                [hf[src + "self_attn.k_proj.weight"], hf[src + "self_attn.v_proj.weight"]])
            out[dst + "attn.proj.weight"] = hf[src + "self_attn.o_proj.weight"]
            if cfg.is_moe_layer(i):
                out.update(_experts_from_hf(hf, src + "block_sparse_moe.", dst + "mlp.",
                                            cfg.moe.num_experts))
            else:
                out[dst + "mlp.gate_up.weight"] = torch.cat(
                    [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
                out[dst + "mlp.down.weight"] = hf[src + "mlp.down_proj.weight"]
            out[dst + "attn_norm.weight"] = hf[src + "input_layernorm.weight"]
            out[dst + "mlp_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
        else:
            src = f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[dst + ours + ".weight"] = hf[src + theirs + ".weight"]
                out[dst + ours + ".bias"] = hf[src + theirs + ".bias"]
            for part in ("weight", "bias"):
                q, kv = _split_c_attn(hf[src + "attn.c_attn." + part], cfg)
                out[dst + "attn.q." + part], out[dst + "attn.kv." + part] = q, kv
            for ours, theirs in GPT2_LINEARS:
                out[dst + ours + ".weight"] = hf[src + theirs + ".weight"].t()
                out[dst + ours + ".bias"] = hf[src + theirs + ".bias"]
    prefix = "model." if llama else "transformer."
    out["embed.weight"] = hf[prefix + ("embed_tokens.weight" if llama else "wte.weight")]
    if llama:
        out["final_norm.weight"] = hf["model.norm.weight"]
    else:
        out["pos_embed.weight"] = hf["transformer.wpe.weight"]
        out["final_norm.weight"] = hf["transformer.ln_f.weight"]
        out["final_norm.bias"] = hf["transformer.ln_f.bias"]
    if not cfg.tie_embeddings:
        out["output.weight"] = hf["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}
