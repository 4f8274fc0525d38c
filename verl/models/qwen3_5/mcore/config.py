"""Qwen3.5 HF config -> megatron-core ``TransformerConfig`` keyword arguments (dense, MoE and their VL wrappers).

Pure (no megatron import), so the mapping is tested on any machine. The kwargs describe the model in
megatron-core's own vocabulary where it has one (``linear_attention_freq`` and the ``linear_*`` GDN sizes,
``attention_output_gate``, ``layernorm_zero_centered_gamma``, ``qk_layernorm``, ``rotary_percent``, the ``moe_*``
keys), so the local spec in :mod:`verl.models.qwen3_5.mcore` and any other consumer read the same fields.
"""

from __future__ import annotations

from typing import Any

from verl.models.mcore.config_converter import MEGATRON_KEY_PREFIX, is_moe
from verl.models.spec import get_text_config

# Keys the converter derives from the HF config; an override of one of these changes the model's math,
# so it is refused (the checkpoint would no longer load into the module it describes).
_ARCHITECTURE_KEYS = frozenset(
    {
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
        "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
        "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "rotary_percent", "rotary_base",
        "layernorm_zero_centered_gamma", "attention_output_gate", "qk_layernorm", "gated_linear_unit",
        "normalization", "add_qkv_bias", "add_bias_linear", "moe_shared_expert_gate", "experimental_attention_variant",
    }
)



def _rope(text) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from transformers 5 ``rope_parameters`` or the older flat keys."""
    params = getattr(text, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    return float(theta), float(partial)


def layer_pattern(text) -> list[int]:
    """megatron-core's ``linear_attention_freq`` list: 1 = Gated DeltaNet layer, 0 = full attention."""
    types = getattr(text, "layer_types", None)
    if not types:
        raise ValueError("Qwen3.5 config has no layer_types; cannot tell Gated DeltaNet from attention layers")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported Qwen3.5 layer_types {unknown}; expected linear_attention/full_attention")
    return [1 if t == "linear_attention" else 0 for t in types]


def _moe_kwargs(text) -> dict[str, Any]:
    """The ``moe_*`` keys of a Qwen3.5-MoE text config."""
    return dict(
        num_moe_experts=int(text.num_experts),
        moe_router_topk=int(text.num_experts_per_tok),
        moe_ffn_hidden_size=int(text.moe_intermediate_size),
        moe_shared_expert_intermediate_size=int(text.shared_expert_intermediate_size) or None,
        moe_shared_expert_gate=bool(getattr(text, "shared_expert_intermediate_size", 0)),
        # softmax over the top-k logits == softmax over all experts, top-k, renormalise (Qwen's router)
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )


def qwen3_5_transformer_config_kwargs(hf_config, dtype: Any = None, **overrides) -> dict:
    """TransformerConfig keyword arguments for a Qwen3.5 HF config (text or VL: the text sub-config is used).

    ``dtype`` (a torch dtype; None means fp32) sets ``params_dtype`` / ``bf16`` / ``fp16`` / ``pipeline_dtype``.
    ``overrides`` are applied last (parallel sizes, recompute, dropout, ...); overriding a key that defines the
    architecture is refused.
    """
    text = get_text_config(hf_config)
    theta, partial = _rope(text)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    act = getattr(text, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Qwen3.5 mcore spec supports hidden_act=silu only, got {act!r}")
    kw: dict[str, Any] = dict(
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        num_attention_heads=int(text.num_attention_heads),
        num_query_groups=int(text.num_key_value_heads),
        kv_channels=int(head_dim),
        ffn_hidden_size=int(getattr(text, "intermediate_size", None) or text.moe_intermediate_size),
        normalization="RMSNorm",
        layernorm_epsilon=float(text.rms_norm_eps),
        layernorm_zero_centered_gamma=True,  # Qwen3.5 RMSNorm scales by (1 + w)
        gated_linear_unit=True,
        activation_func_name="silu",  # resolved to torch.nn.functional.silu by build_transformer_config
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(text, "attention_bias", False)),
        qk_layernorm=True,
        attention_output_gate=True,
        rotary_percent=partial,
        rotary_base=theta,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(text, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(text, "initializer_range", 0.02)),
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=layer_pattern(text),
        linear_conv_kernel_dim=int(text.linear_conv_kernel_dim),
        linear_key_head_dim=int(text.linear_key_head_dim),
        linear_value_head_dim=int(text.linear_value_head_dim),
        linear_num_key_heads=int(text.linear_num_key_heads),
        linear_num_value_heads=int(text.linear_num_value_heads),
        variable_seq_lengths=True,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # The local (pure PyTorch) spec; "transformer_engine" swaps in TE's linear layers where TE is installed.
        transformer_impl="local",
        # megatron-core refuses its default "allgather" dispatcher with variable sequence lengths, even when
        # the model is dense.
        moe_token_dispatcher_type="alltoall",
    )
    if is_moe(hf_config):
        kw.update(_moe_kwargs(text))
    import torch

    if dtype is None:  # megatron-core needs a pipeline dtype as soon as pipeline parallelism is on
        dtype = torch.float32
    kw.update(params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    bad = sorted(k for k in overrides if k in _ARCHITECTURE_KEYS and overrides[k] != kw.get(k))
    if bad:
        raise ValueError(
            f"{MEGATRON_KEY_PREFIX}.override_transformer_config may not change {bad}: they are read from the "
            "checkpoint's config.json and define how its weights load"
        )
    kw.update(overrides)
    return kw
