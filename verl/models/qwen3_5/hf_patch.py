"""Installs Qwen3.5's packed / padding-safe / Ulysses-aware forwards on the modules of a loaded HF model (dense,
MoE, VL); the model spec names :func:`patch_qwen3_5_modules` and ``monkey_patch.apply_monkey_patch`` calls it."""

from __future__ import annotations

import importlib

import torch.nn as nn

from verl.models.spec import get_text_config
from verl.models.transformers.patching import base_class, bind_forward, with_stock_signature

# Class-name suffix (after "Qwen3_5" / "Qwen3_5Moe") -> "module.function" of its replacement forward. Suffixes are
# matched exactly, so "Model" is only the VL wrapper. The causal-LM heads get the normal (logits) backend;
# use_fused_kernels then swaps in a fused one.
_REPLACEMENTS = {
    "TextModel": "verl.models.qwen3_5.hf_forward.text_model_forward",
    "Model": "verl.models.qwen3_5.hf_forward.vl_model_forward",
    "VisionModel": "verl.models.qwen3_5.hf_forward.vision_forward",
    "DecoderLayer": "verl.models.qwen3_5.hf_forward.decoder_layer_forward",
    "GatedDeltaNet": "verl.models.qwen3_5.gated_deltanet.gated_deltanet_forward",
    "Attention": "verl.models.qwen3_5.hf_attention.gated_attention_forward",
    "ForCausalLM": "verl.models.transformers.fused_forward.forward_with_normal_backend",
    "ForConditionalGeneration": "verl.models.transformers.fused_forward.forward_with_normal_backend",
}
_HEAD_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")


def _replacements() -> dict[type, object]:
    """{HF class: replacement forward} for the dense and MoE modeling files."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

    table = {}
    for suffix, target in _REPLACEMENTS.items():
        mod_name, _, fn_name = target.rpartition(".")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        for hf_mod, prefix in ((dense, "Qwen3_5"), (moe, "Qwen3_5Moe")):
            cls = getattr(hf_mod, prefix + suffix, None)
            if cls is not None:
                table[cls] = with_stock_signature(cls, fn) if suffix in _HEAD_SUFFIXES else fn
    return table


def _check_sp_divisibility(model: nn.Module, sp: int) -> None:
    if sp <= 1:
        return
    cfg = get_text_config(model.config)
    for name in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
        value = getattr(cfg, name)
        if value % sp != 0:
            raise ValueError(f"{name}={value} is not divisible by ulysses_sequence_parallel_size={sp}")


def patch_qwen3_5_modules(model: nn.Module, ulysses_sp_size: int = 1) -> int:
    """Bind the replacement forwards to every Qwen3.5 module of ``model``; returns how many were patched."""
    _check_sp_divisibility(model, ulysses_sp_size)
    table = _replacements()
    count = 0
    for module in model.modules():
        # Exact class lookup (a subclass plays another role), through FSDP2's wrapper subclass if present.
        fn = table.get(base_class(module))
        if fn is not None:
            bind_forward(module, fn)
            count += 1
    return count
