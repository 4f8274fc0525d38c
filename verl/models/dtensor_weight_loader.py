"""Custom weight loaders for the rollout engine, keyed by model architecture (seed 003, section 2.2).

Every Hugging Face causal LM that vLLM supports syncs without any of this: the trainer streams HF-named
tensors and vLLM's own ``load_weights`` maps, fuses and shards them. A loader is needed only for a model
whose checkpoint names vLLM's class does not understand (a custom or renamed architecture). Register it
before ``main_ppo`` runs (a launcher script, or a module named in ``actor_rollout_ref.model.external_lib``)::

    from verl.models.dtensor_weight_loader import register_weight_loader

    @register_weight_loader("MyModelForCausalLM")
    def my_loader(actor_weights: dict, vllm_model):
        params = dict(vllm_model.named_parameters())
        for name, w in actor_weights.items():
            param = params[my_name_map(name)]
            loader = getattr(param, "weight_loader", None) or default_weight_loader
            loader(param, w.to(param.dtype))
        return vllm_model

``actor_weights`` holds full (gathered) HF-named tensors. The loader runs inside vLLM's in-place reload, so
every ``param.weight_loader(...)`` it calls is followed by the layer's post-load processing exactly as in a
checkpoint load, and every engine parameter it did not write is reported by the coverage check.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from verl.utils.registry import Registry

WeightLoader = Callable[[dict, Any], Any]

WEIGHT_LOADER_REGISTRY: Registry = Registry("rollout weight loader")


def register_weight_loader(architecture: str, loader: Optional[WeightLoader] = None, *, override: bool = False):
    """Register ``loader(actor_weights, vllm_model) -> vllm_model`` for ``architecture`` (the class name in
    the checkpoint's ``config.json`` ``architectures``). Usable as a decorator."""
    return WEIGHT_LOADER_REGISTRY.register(architecture, loader, override=override)


def get_weight_loader(architectures) -> Optional[WeightLoader]:
    """The loader registered for the first of ``architectures`` that has one, else None (vLLM's own)."""
    for arch in architectures or ():
        if arch in WEIGHT_LOADER_REGISTRY:
            return WEIGHT_LOADER_REGISTRY.get_or_raise(arch)
    return None


__all__ = ["WEIGHT_LOADER_REGISTRY", "WeightLoader", "get_weight_loader", "register_weight_loader"]
