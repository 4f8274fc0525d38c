"""Megatron checkpoint loaders and savers by architecture (upstream's ``verl.models.weight_loader_registry``).

``get_weight_loader(arch)`` gives ``loader(state_dict, wrapped_models, config, params_dtype, is_value_model)``,
which copies an HF state dict into megatron-core model chunks; ``get_weight_saver(arch)`` gives
``saver(wrapped_models, config, dtype, is_value_model, tie_word_embeddings)``, which merges the chunks back into an
HF state dict. Architectures register here from their package's ``spec`` (Qwen3.5: the generic GPT pair of
:mod:`verl.models.mcore.gpt_checkpoint`, driven by its weight converter)::

    from verl.models.weight_loader_registry import register_megatron_checkpoint_io
    register_megatron_checkpoint_io("MyModelForCausalLM", loader="my_pkg.load", saver="my_pkg.save")

The rollout engine's custom HF -> vLLM loaders (upstream's dtensor weight loaders) are a different registry:
:mod:`verl.models.dtensor_weight_loader`.
"""

from __future__ import annotations

from typing import Any

from verl.utils.registry import Registry

__all__ = ["MEGATRON_LOADER_REGISTRY", "MEGATRON_SAVER_REGISTRY", "get_weight_loader", "get_weight_saver",
           "register_megatron_checkpoint_io"]

GPT_LOADER = "verl.models.mcore.gpt_checkpoint.load_state_dict_to_megatron_gptmodel"
GPT_SAVER = "verl.models.mcore.gpt_checkpoint.merge_megatron_ckpt_gptmodel"

MEGATRON_LOADER_REGISTRY = Registry("megatron checkpoint loader", config_key="config.json architectures")
MEGATRON_SAVER_REGISTRY = Registry("megatron checkpoint saver", config_key="config.json architectures")


def register_megatron_checkpoint_io(arch: str, loader: Any = GPT_LOADER, saver: Any = GPT_SAVER,
                                    override: bool = False) -> None:
    """Register ``arch``'s loader and saver (objects or dotted paths; the generic GPT pair by default)."""
    MEGATRON_LOADER_REGISTRY.register(arch, loader, override=override)
    MEGATRON_SAVER_REGISTRY.register(arch, saver, override=override)


def _lookup(registry: Registry, arch: str, what: str):
    if arch not in registry:
        raise ValueError(f"Model architectures {arch} {what} are not supported for now. Supported architectures: "
                         f"{sorted(registry)}")
    return registry.get_or_raise(arch)


def get_weight_loader(arch: str):
    """The Megatron loader registered for ``arch``; ValueError naming the supported ones otherwise."""
    return _lookup(MEGATRON_LOADER_REGISTRY, arch, "loader")


def get_weight_saver(arch: str):
    """The Megatron saver registered for ``arch``; ValueError naming the supported ones otherwise."""
    return _lookup(MEGATRON_SAVER_REGISTRY, arch, "saver")
