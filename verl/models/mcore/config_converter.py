"""Model-independent half of HF config -> megatron-core ``TransformerConfig``.

Each architecture's converter (registered in :mod:`verl.models.mcore.registry`, e.g.
``verl.models.qwen3_5.mcore.config``) returns TransformerConfig keyword arguments; :func:`build_transformer_config`
is the only place that imports megatron-core, and :func:`check_parallel_sizes` is pure so the parallel-size rules
are tested on any machine.
"""

from __future__ import annotations

from typing import Any, Optional

from verl.models.spec import get_text_config

MEGATRON_KEY_PREFIX = "actor_rollout_ref.actor.megatron"

# Keys the model reads that megatron-core keeps outside TransformerConfig.
_MODEL_LEVEL_KEYS = ("rotary_percent", "rotary_base")
# MindSpeed names of upstream's Qwen3.5 scripts this project applies (verl/workers/engine/megatron/config_fields.py:
# APPLIED_EXTRAS says what each does); kept on the config object like the model-level keys.
EXTRA_MODEL_KEYS = ("use_naive_l2norm", "use_flash_attn")


def is_moe(hf_config) -> bool:
    return int(getattr(get_text_config(hf_config), "num_experts", 0) or 0) > 0


def tie_word_embeddings(hf_config) -> bool:
    text = get_text_config(hf_config)
    return bool(getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))


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
    model_level = {k: kwargs.pop(k) for k in (*_MODEL_LEVEL_KEYS, *EXTRA_MODEL_KEYS) if k in kwargs and k not in fields}
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
    if getattr(text, "linear_num_key_heads", None):  # Gated DeltaNet layers split their heads too
        need(text.linear_num_key_heads, tp, "linear_num_key_heads (Gated DeltaNet key heads)",
             "tensor_model_parallel_size")
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
    if getattr(text, "linear_num_key_heads", None) and cp > 1:
        # megatron-core's TransformerConfig requires it of every Gated DeltaNet config (its own GDN splits heads
        # over TP x CP); this project's CP keeps the heads whole, but the config is built by megatron-core
        for heads, what in ((text.linear_num_key_heads, "linear_num_key_heads"),
                            (text.linear_num_value_heads, "linear_num_value_heads")):
            if heads % (tp * cp):
                msgs.append(f"{k('context_parallel_size')}={cp}: tensor_model_parallel_size * context_parallel_size "
                            f"({tp * cp}) does not divide {what} ({heads}) (megatron-core's rule for Gated DeltaNet "
                            "configs); pick sizes whose product divides it")
    chunks = pp * (vpp or 1)
    if vpp not in (None, 1) and pp < 2:
        msgs.append(f"{k('virtual_pipeline_model_parallel_size')}={vpp} needs pipeline_model_parallel_size > 1")
    if text.num_hidden_layers % chunks:
        key = "virtual_pipeline_model_parallel_size" if vpp not in (None, 1) else "pipeline_model_parallel_size"
        msgs.append(f"{k(key)}: num_hidden_layers ({text.num_hidden_layers}) must split evenly into "
                    f"pipeline_model_parallel_size * virtual_pipeline_model_parallel_size = {chunks} stages")
    return msgs
