"""Helpers every model's patched forwards share: binding a forward to one module instance, finding a module's
transformers modeling file through FSDP2's wrapper subclass, and presenting a replacement top-level forward with
the stock signature (``generate`` reads it)."""

from __future__ import annotations

import functools
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


def modeling_module_name(module: nn.Module) -> str:
    """The transformers modeling file of ``module``'s class, seen through FSDP2's wrapper subclass (which
    lives in torch's FSDP package): patched forwards look their helpers up there."""
    return base_class(module).__module__


def base_class(module: nn.Module) -> type:
    for cls in type(module).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls
    return type(module)
