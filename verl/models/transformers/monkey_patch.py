"""Entry point the FSDP actor calls after loading a model: ``apply_monkey_patch``.

What gets patched is the model spec's business (``ModelSpec.patches``, e.g. Qwen3.5's packed, padding-safe and
Ulysses-aware forwards in :mod:`verl.models.qwen3_5.hf_patch`). Patches are installed on *instances*
(``module.forward = ...``), not classes, so an unpatched model of the same class (e.g. a reference copy, or the
HF oracle in tests) keeps the stock behaviour, and applying twice is a no-op. The top-level forward of a patched
causal LM is one of three backends of :mod:`verl.models.transformers.fused_forward`:
``forward_with_normal_backend`` (logits, and the MoE router's load-balancing loss when asked for) or, with
``use_fused_kernels``, ``forward_with_torch_backend`` / ``forward_with_triton_backend`` (per-token log-probs
and entropy); all three hand cached decoding (``generate``) to the stock forward. Models whose spec names no
patches are left untouched, except that ``use_fused_kernels`` swaps their top-level forward for the fused
log-prob one (it only relies on ``.model`` and ``.lm_head``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.nn as nn

from verl.models.spec import get_model_spec
from verl.models.transformers import fused_forward
from verl.models.transformers.patching import base_class, bind_forward, with_stock_signature

logger = logging.getLogger(__name__)

_PATCH_ATTR = "_verl_patch_settings"
_FUSED_FORWARDS = {
    "torch": fused_forward.forward_with_torch_backend,
    "triton": fused_forward.forward_with_triton_backend,
}


def _patch_installer(model: nn.Module):
    """The spec's ``patches`` function for ``model`` (None: stock forwards)."""
    config = getattr(model, "config", None)
    return None if config is None else get_model_spec(config).resolve("patches")


def patch_forward_with_backends(
    model: nn.Module, use_fused_kernels: bool = False, fused_kernels_backend: Optional[str] = None
):
    """Swap the top-level forward for a fused log-prob/entropy one (``temperature=`` kwarg, returns
    ``CausalLMOutputForPPO``). No-op unless ``use_fused_kernels``."""
    if not use_fused_kernels:
        return
    backend = fused_kernels_backend or "torch"
    if backend not in _FUSED_FORWARDS:
        raise ValueError(f"fused_kernels_backend must be 'torch' or 'triton', got {fused_kernels_backend!r}")
    if not (hasattr(model, "lm_head") and hasattr(model, "model")):
        raise ValueError(f"fused kernels need a causal LM with .model and .lm_head, got {type(model).__name__}")
    bind_forward(model, with_stock_signature(base_class(model), _FUSED_FORWARDS[backend]))
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

    Patched models take packed ``(1, T)`` inputs with ``attention_mask=None`` and position ids that restart at 0
    per sequence, and padded ``(B, L)`` inputs with a 2D mask; Ulysses SP (models whose spec supports it) runs
    through the registered group (:func:`verl.utils.ulysses.set_ulysses_sequence_parallel_group`). Padded inputs
    are handled whether or not ``use_remove_padding`` is set. Applying again with the same settings changes
    nothing; different settings re-patch from the stock forwards.
    """
    if use_prefix_grouper or use_tiled_mlp:
        raise NotImplementedError("prefix grouper and tiled MLP are not supported by this framework")
    settings = (int(ulysses_sp_size), bool(use_remove_padding), bool(use_fused_kernels), fused_kernels_backend)
    previous = getattr(model, _PATCH_ATTR, None)
    if previous == settings:
        return model
    if previous is not None:
        _restore_stock_forward(model)

    install = _patch_installer(model)
    spec = get_model_spec(model.config) if install is not None else None
    if ulysses_sp_size > 1 and (spec is None or not spec.supports_ulysses):
        raise NotImplementedError(
            f"Ulysses sequence parallelism is not implemented for {type(model).__name__} (its model spec does not "
            "support it); set ulysses_sequence_parallel_size=1"
        )
    if install is not None:
        n = install(model, ulysses_sp_size)
        logger.info("patched %d %s modules of %s", n, spec.family, type(model).__name__)
    patch_forward_with_backends(model, use_fused_kernels, fused_kernels_backend)
    setattr(model, _PATCH_ATTR, settings)
    return model
