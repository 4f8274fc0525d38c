"""Helpers every model's patched forwards share: binding a forward to one module instance, finding a module's
transformers modeling file (named by its model spec, whatever class FSDP2 gave the module), and presenting a replacement top-level forward with
the stock signature (``generate`` reads it)."""

from __future__ import annotations

import functools
import importlib
import inspect
import types

import torch.nn as nn


def bind_forward(module: nn.Module, fn) -> None:
    """Patch one instance (not its class): an unpatched model of the same class keeps the stock forward."""
    module.forward = types.MethodType(fn, module)


@functools.lru_cache(maxsize=None)
def with_stock_signature(cls: type, fn):
    """``fn`` (a top-level forward taking keywords) presented with ``cls.forward``'s signature plus ``temperature``
    and ``shift_labels``: HF ``generate`` reads the forward's signature to decide what to pass (attention_mask,
    position_ids, logits_to_keep, pixel inputs), and positional calls bind as they would on the stock forward."""
    stock = inspect.signature(cls.forward)
    params = [p for p in stock.parameters.values() if p.kind is not p.VAR_KEYWORD]
    var_kw = [p for p in stock.parameters.values() if p.kind is p.VAR_KEYWORD]
    names = {p.name for p in params}
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d)
             for n, d in (("temperature", 1.0), ("shift_labels", None)) if n not in names]
    signature = stock.replace(parameters=params + extra + var_kw)
    self_name = params[0].name

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        given.pop(self_name)
        for p in var_kw:
            given.update(given.pop(p.name, {}))
        return fn(self, **given)

    forward.__signature__ = signature
    return forward


def modeling_module(module: nn.Module):
    """The transformers modeling file (the module object) whose plain helpers a patched forward of ``module``
    reuses (``apply_rotary_pos_emb``, ``load_balancing_loss_func``, output classes).

    Named by the model spec (:attr:`verl.models.spec.ModelSpec.hf_modeling`, looked up from the module's
    config), never by the runtime class: FSDP2's ``fully_shard`` swaps a module's class for a subclass created
    in torch's FSDP package, and a wrap policy may wrap any block (``wrap_policy.min_num_params=1`` wraps the
    attention modules themselves). Models whose spec names no file (the generic spec) fall back to the module
    of the unwrapped class.
    """
    config = getattr(module, "config", None)
    key = (base_class(module), getattr(config, "model_type", None), tuple(getattr(config, "architectures", None) or ()))
    return _modeling_module(key, config)


def modeling_module_name(module: nn.Module) -> str:
    """``modeling_module(module).__name__``."""
    return modeling_module(module).__name__


def _modeling_module(key, config):
    cached = _MODELING_CACHE.get(key)
    if cached is None:
        cached = _MODELING_CACHE[key] = importlib.import_module(_modeling_path(key[0], config))
    return cached


_MODELING_CACHE: dict = {}


def _modeling_path(cls: type, config) -> str:
    if config is not None:
        from verl.models.spec import get_model_spec

        path = get_model_spec(config).hf_modeling
        if path:
            return path
    return cls.__module__


def base_class(module: nn.Module) -> type:
    """``module``'s own class, seen through FSDP2's wrapper subclass (``FSDP<Name>``, created by
    ``fully_shard`` in torch's FSDP package)."""
    from torch.distributed.fsdp import FSDPModule

    for cls in type(module).__mro__:
        if not (isinstance(cls, type) and issubclass(cls, FSDPModule)):
            return cls
    return type(module)
