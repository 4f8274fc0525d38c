"""Hugging Face config -> megatron-core ``TransformerConfig`` for Qwen3.5 (dense, MoE and their VL wrappers).

:func:`qwen3_5_transformer_config_kwargs` and :func:`check_parallel_sizes` are pure functions (no megatron
import) so the mapping and the parallel-size rules are tested on any machine; :func:`build_transformer_config`
is the only place that imports megatron-core.

The kwargs describe the model in megatron-core's own vocabulary where it has one (``linear_attention_freq``
and the ``linear_*`` GDN sizes, ``attention_output_gate``, ``layernorm_zero_centered_gamma``, ``qk_layernorm``,
``rotary_percent``, the ``moe_*`` keys), so the local spec in :mod:`verl.models.mcore.qwen3_5` and any other
consumer read the same fields.
"""

from __future__ import annotations

from typing import Any, Optional

from verl.models.registry import get_text_config

MEGATRON_KEY_PREFIX = "actor_rollout_ref.actor.megatron"

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


# Keys the model reads that megatron-core keeps outside TransformerConfig.
_MODEL_LEVEL_KEYS = ("rotary_percent", "rotary_base")


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


def is_moe(hf_config) -> bool:
    return int(getattr(get_text_config(hf_config), "num_experts", 0) or 0) > 0


def tie_word_embeddings(hf_config) -> bool:
    text = get_text_config(hf_config)
    return bool(getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))


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
        kw.update(
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


def build_transformer_config(kwargs: dict):
    """Construct the megatron-core TransformerConfig (the one megatron import of this module)."""
    import torch.nn.functional as F

    from verl.models.mcore import require_megatron

    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    import dataclasses

    kwargs = dict(kwargs)
    act = kwargs.pop("activation_func_name", "silu")
    kwargs["activation_func"] = {"silu": F.silu, "swish": F.silu}[act]
    # Rotary settings are model-level in megatron-core (GPTModel arguments), not TransformerConfig fields: keep
    # them on the config object so the model reads one place.
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model_level = {k: kwargs.pop(k) for k in _MODEL_LEVEL_KEYS if k in kwargs and k not in fields}
    unknown = sorted(k for k in kwargs if k not in fields)
    if unknown:
        raise ValueError(f"{MEGATRON_KEY_PREFIX}.override_transformer_config: {unknown} are not megatron-core "
                         "TransformerConfig fields")
    config = TransformerConfig(**kwargs)
    for k, v in model_level.items():
        setattr(config, k, v)
    return config


# ----------------------------------------------------------------------------------------------------------
# Parallel sizes
# ----------------------------------------------------------------------------------------------------------


def check_parallel_sizes(
    hf_config,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    sequence_parallel: Optional[bool] = None,
    key_prefix: str = MEGATRON_KEY_PREFIX,
) -> list[str]:
    """Every reason these parallel sizes cannot run this model, each naming the key to change ([] = fine)."""
    text = get_text_config(hf_config)
    k = lambda name: f"{key_prefix}.{name}"  # noqa: E731
    msgs: list[str] = []
    for name, value in (
        ("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
    ):
        if not isinstance(value, int) or value < 1:
            msgs.append(f"{k(name)}={value!r} must be a positive integer")
    if msgs:
        return msgs
    etp = tp if etp is None else etp

    def need(value: int, size: int, what: str, key: str):
        if value % size:
            msgs.append(f"{k(key)}={size} does not divide {what} ({value}); pick a divisor of {value}")

    need(text.num_attention_heads, tp, "num_attention_heads", "tensor_model_parallel_size")
    need(text.num_key_value_heads, tp, "num_key_value_heads (KV heads are split, not replicated)",
         "tensor_model_parallel_size")
    need(text.linear_num_key_heads, tp, "linear_num_key_heads (Gated DeltaNet key heads)", "tensor_model_parallel_size")
    need(text.linear_num_value_heads, tp, "linear_num_value_heads (Gated DeltaNet value heads)",
         "tensor_model_parallel_size")
    need(text.vocab_size, tp, "vocab_size", "tensor_model_parallel_size")
    if getattr(text, "intermediate_size", None) and not is_moe(hf_config):
        need(text.intermediate_size, tp, "intermediate_size", "tensor_model_parallel_size")
    if is_moe(hf_config):
        need(text.num_experts, ep, "num_experts", "expert_model_parallel_size")
        need(text.moe_intermediate_size, etp, "moe_intermediate_size", "expert_tensor_parallel_size")
        if getattr(text, "shared_expert_intermediate_size", 0):
            need(text.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size",
                 "tensor_model_parallel_size")
        if tp > 1 and sequence_parallel is False:
            msgs.append(f"{k('sequence_parallel')}=False: megatron-core needs sequence parallelism for a MoE "
                        "model with tensor parallelism; set it to True")
    elif ep > 1:
        msgs.append(f"{k('expert_model_parallel_size')}={ep} needs a MoE model; this checkpoint is dense")
    chunks = pp * (vpp or 1)
    if vpp not in (None, 1) and pp < 2:
        msgs.append(f"{k('virtual_pipeline_model_parallel_size')}={vpp} needs pipeline_model_parallel_size > 1")
    if text.num_hidden_layers % chunks:
        key = "virtual_pipeline_model_parallel_size" if vpp not in (None, 1) else "pipeline_model_parallel_size"
        msgs.append(f"{k(key)}: num_hidden_layers ({text.num_hidden_layers}) must split evenly into "
                    f"pipeline_model_parallel_size * virtual_pipeline_model_parallel_size = {chunks} stages")
    if cp > 1:
        msgs.append(f"{k('context_parallel_size')}={cp}: the local Qwen3.5 spec (Gated DeltaNet and gated "
                    "attention without Transformer Engine) has no context parallelism; set it to 1")
    return msgs
