"""Entry point the FSDP actor calls after loading a model: ``apply_monkey_patch``.

Qwen3.5 models (dense / MoE / VL) get packed-sequence, padding-safe and Ulysses-aware forwards. Patches are
installed on *instances* (``module.forward = ...``), not classes, so an unpatched model of the same class
(e.g. a reference copy, or the HF oracle in tests) keeps the stock behaviour, and applying twice is a no-op.
The top-level forward of a Qwen3.5 causal LM is one of three backends chosen here: ``forward_with_normal_backend``
(logits, and the MoE router's load-balancing loss when asked for) or, with ``use_fused_kernels``,
``forward_with_torch_backend`` / ``forward_with_triton_backend`` (per-token log-probs and entropy); all three hand
cached decoding (``generate``) to the stock forward. Other architectures are left untouched, except that ``use_fused_kernels`` swaps their top-level forward for
the fused log-prob one (it only relies on ``.model`` and ``.lm_head``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Optional

import torch.nn as nn

logger = logging.getLogger(__name__)

_PATCH_ATTR = "_verl_patch_settings"


# Class-name suffix (after "Qwen3_5" / "Qwen3_5Moe") -> "module.function" of its replacement forward, the
# module being under verl.models.transformers. Suffixes are matched exactly, so "Model" is only the VL wrapper.
# The causal-LM heads get the normal (logits) backend; use_fused_kernels then swaps in a fused one.
_REPLACEMENTS = {
    "TextModel": "qwen3_5.text_model_forward", "Model": "qwen3_5.vl_model_forward",
    "VisionModel": "qwen3_5.vision_forward", "DecoderLayer": "qwen3_5.decoder_layer_forward",
    "GatedDeltaNet": "gated_deltanet.gated_deltanet_forward", "Attention": "packed_attention.gated_attention_forward",
    "ForCausalLM": "qwen3_5.forward_with_normal_backend",
    "ForConditionalGeneration": "qwen3_5.forward_with_normal_backend",
}
_HEAD_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")


def _qwen3_5_replacements() -> dict[type, object]:
    """{HF class: replacement forward} for the dense and MoE modeling files."""
    import importlib

    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe

    table = {}
    for suffix, target in _REPLACEMENTS.items():
        mod_name, fn_name = target.split(".")
        fn = getattr(importlib.import_module(f"verl.models.transformers.{mod_name}"), fn_name)
        for hf_mod, prefix in ((dense, "Qwen3_5"), (moe, "Qwen3_5Moe")):
            cls = getattr(hf_mod, prefix + suffix, None)
            if cls is not None:
                table[cls] = with_stock_signature(cls, fn) if suffix in _HEAD_SUFFIXES else fn
    return table


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


def is_qwen3_5_model(model: nn.Module) -> bool:
    """Whether the model spec of ``model`` asks for the Qwen3.5 patches."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    from verl.models.registry import get_model_spec

    return get_model_spec(config).patches == "qwen3_5"


def _bind(module: nn.Module, fn) -> None:
    module.forward = types.MethodType(fn, module)


def _patch_qwen3_5_modules(model: nn.Module) -> int:
    table = _qwen3_5_replacements()
    count = 0
    for module in model.modules():
        # Exact class lookup (a subclass plays another role), through FSDP2's wrapper subclass if present.
        fn = table.get(_base_class(module))
        if fn is not None:
            _bind(module, fn)
            count += 1
    return count


def modeling_module_name(module: nn.Module) -> str:
    """The transformers modeling file of ``module``'s class, seen through FSDP2's wrapper subclass (which
    lives in torch's FSDP package): patched forwards look their helpers up there."""
    return _base_class(module).__module__


def _base_class(module: nn.Module) -> type:
    for cls in type(module).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls
    return type(module)


def _fused_forward_fns():
    from verl.models.transformers import qwen3_5

    return {"torch": qwen3_5.forward_with_torch_backend, "triton": qwen3_5.forward_with_triton_backend}


def patch_forward_with_backends(
    model: nn.Module, use_fused_kernels: bool = False, fused_kernels_backend: Optional[str] = None
):
    """Swap the top-level forward for a fused log-prob/entropy one (``temperature=`` kwarg, returns
    ``Qwen3_5CausalLMOutputForPPO``). No-op unless ``use_fused_kernels``."""
    if not use_fused_kernels:
        return
    backend = fused_kernels_backend or "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"fused_kernels_backend must be 'torch' or 'triton', got {fused_kernels_backend!r}")
    if not (hasattr(model, "lm_head") and hasattr(model, "model")):
        raise ValueError(f"fused kernels need a causal LM with .model and .lm_head, got {type(model).__name__}")
    _bind(model, with_stock_signature(_base_class(model), _fused_forward_fns()[backend]))
    model._verl_fused_kernels_backend = backend


def _restore_stock_forward(model: nn.Module) -> None:
    # Dropping the instance attribute re-exposes the class's forward.
    for module in model.modules():
        if "forward" in module.__dict__:
            del module.__dict__["forward"]


def apply_monkey_patch(
    model: nn.Module,
    ulysses_sp_size: int = 1,
    use_remove_padding: bool = True,
    use_fused_kernels: bool = False,
    fused_kernels_backend: Optional[str] = None,
    use_prefix_grouper: bool = False,
    use_tiled_mlp: bool = False,
    tiled_mlp_shards: int = 4,
) -> nn.Module:
    """Patch ``model`` in place for the FSDP actor and return it.

    Qwen3.5: packed ``(1, T)`` inputs with ``attention_mask=None`` and position ids that restart at 0 per
    sequence; padded ``(B, L)`` inputs with a 2D mask; Ulysses SP through the registered group
    (:func:`verl.utils.ulysses.set_ulysses_sequence_parallel_group`). Padded inputs are handled whether
    or not ``use_remove_padding`` is set. Applying again with the same settings changes nothing; different
    settings re-patch from the stock forwards.
    """
    if use_prefix_grouper or use_tiled_mlp:
        raise NotImplementedError("prefix grouper and tiled MLP are not supported by this framework")
    settings = (int(ulysses_sp_size), bool(use_remove_padding), bool(use_fused_kernels), fused_kernels_backend)
    previous = getattr(model, _PATCH_ATTR, None)
    if previous == settings:
        return model
    if previous is not None:
        _restore_stock_forward(model)

    if is_qwen3_5_model(model):
        _check_sp_divisibility(model, ulysses_sp_size)
        n = _patch_qwen3_5_modules(model)
        logger.info("patched %d Qwen3.5 modules of %s", n, type(model).__name__)
    elif ulysses_sp_size > 1:
        raise NotImplementedError(
            f"Ulysses sequence parallelism is implemented for Qwen3.5 models only, not {type(model).__name__}"
        )
    patch_forward_with_backends(model, use_fused_kernels, fused_kernels_backend)
    setattr(model, _PATCH_ATTR, settings)
    return model


def _check_sp_divisibility(model: nn.Module, sp: int) -> None:
    if sp <= 1:
        return
    from verl.models.registry import get_text_config

    cfg = get_text_config(model.config)
    for name in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
        value = getattr(cfg, name)
        if value % sp != 0:
            raise ValueError(f"{name}={value} is not divisible by ulysses_sequence_parallel_size={sp}")
