"""Installs Qwen3's packed forwards on a loaded ``Qwen3ForCausalLM`` (the model spec names
:func:`patch_qwen3_modules`; ``monkey_patch.apply_monkey_patch`` calls it)."""

from __future__ import annotations

import torch.nn as nn

from verl.models.qwen3.hf_forward import attention_forward, text_model_forward
from verl.models.transformers.fused_forward import forward_with_normal_backend
from verl.models.transformers.patching import base_class, bind_forward, with_stock_signature


def _replacements() -> dict[type, object]:
    from transformers.models.qwen3 import modeling_qwen3 as hf

    return {
        hf.Qwen3Model: text_model_forward,
        hf.Qwen3Attention: attention_forward,
        hf.Qwen3ForCausalLM: with_stock_signature(hf.Qwen3ForCausalLM, forward_with_normal_backend),
    }


def patch_qwen3_modules(model: nn.Module, ulysses_sp_size: int = 1) -> int:
    """Bind the packed forwards to every Qwen3 module of ``model``; returns how many were patched."""
    if ulysses_sp_size > 1:  # the spec says so too (supports_ulysses=False); this guards direct calls
        raise NotImplementedError("Ulysses sequence parallelism is not implemented for Qwen3")
    if getattr(model.config, "use_sliding_window", False):
        raise NotImplementedError("Qwen3 with use_sliding_window=True: the packed forward has no sliding window")
    table = _replacements()
    count = 0
    for module in model.modules():
        fn = table.get(base_class(module))  # exact class, through FSDP2's wrapper subclass
        if fn is not None:
            bind_forward(module, fn)
            count += 1
    return count
