"""Qwen3.5's FLOPs formula (gated full attention, Gated DeltaNet, SwiGLU or MoE MLPs), named by its model spec;
the conventions and shared building blocks are :mod:`verl.utils.flops_counter`'s."""

from __future__ import annotations

from verl.utils import flops_counter as fc


def _gated_attention_params(cfg) -> int:
    """Qwen3.5 full attention: q_proj emits queries and a same-size output gate."""
    hd = fc.head_dim(cfg)
    q = cfg.num_attention_heads * hd
    kv = cfg.num_key_value_heads * hd
    return cfg.hidden_size * (2 * q + 2 * kv) + q * cfg.hidden_size


def _gdn_params(cfg) -> int:
    """Gated DeltaNet projections: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj."""
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    nv = cfg.linear_num_value_heads
    h = cfg.hidden_size
    return h * (2 * key_dim + value_dim) + h * value_dim + 2 * h * nv + value_dim * h


def _gdn_conv_macs_per_token(cfg) -> int:
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim += cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return conv_dim * cfg.linear_conv_kernel_dim


def _layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    interval = getattr(cfg, "full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg.num_hidden_layers)]


def _mlp_params(cfg) -> int:
    """Matmul weights a token passes through in one MLP/MoE block."""
    h = cfg.hidden_size
    if getattr(cfg, "num_experts", None):
        params = h * cfg.num_experts  # router
        params += cfg.num_experts_per_tok * fc.swiglu_params(h, cfg.moe_intermediate_size)
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        if shared:
            params += fc.swiglu_params(h, shared) + h  # shared expert + its sigmoid gate
        return params
    return fc.swiglu_params(h, cfg.intermediate_size)


def qwen3_5_forward_flops(config, batch_seqlens) -> float:
    """Qwen3.5 dense / MoE (text or VL config): gated full attention, Gated DeltaNet, SwiGLU or MoE MLPs."""
    cfg = fc.text_config(config)
    tokens = sum(batch_seqlens)
    types = _layer_types(cfg)
    n_full = sum(t == "full_attention" for t in types)
    n_lin = sum(t == "linear_attention" for t in types)
    if n_full + n_lin != len(types):
        raise ValueError(f"unknown layer types in {sorted(set(types))}")

    macs_per_token = len(types) * _mlp_params(cfg)
    macs_per_token += n_full * _gated_attention_params(cfg)
    macs_per_token += n_lin * (_gdn_params(cfg) + _gdn_conv_macs_per_token(cfg))
    macs_per_token += cfg.hidden_size * cfg.vocab_size  # lm_head
    flops = 2 * macs_per_token * tokens
    flops += n_full * fc.causal_attention_fwd(batch_seqlens, cfg.num_attention_heads, fc.head_dim(cfg))
    delta = fc.gdn_delta_rule_macs_per_token(cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    flops += 2 * n_lin * cfg.linear_num_value_heads * delta * tokens
    return flops
