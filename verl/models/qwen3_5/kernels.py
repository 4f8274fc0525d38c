"""Which kernels Qwen3.5's own parts run with (the model spec names :func:`kernel_choices`; the shared report of
:mod:`verl.models.kernels` adds packed attention and says it all once at start-up)."""

from __future__ import annotations

import os

from verl.models import kernels as shared
from verl.models.qwen3_5 import gated_deltanet as gdn
from verl.models.kernels import KernelChoice


def _fla_importable() -> bool:
    # The import the delta rule does (an installed fla built for another torch counts as absent).
    return gdn._fla_functions() is not None


def _gdn_choice(on_cuda: bool) -> KernelChoice:
    if os.environ.get(gdn.GDN_BACKEND_ENV, "auto").lower() == "torch":
        return KernelChoice(f"torch ({gdn.GDN_BACKEND_ENV}=torch)")
    if not on_cuda:
        return KernelChoice("torch")
    if not _fla_importable():
        return KernelChoice("torch", slow=True, kernel="fla")
    if gdn.fla_conv_available():
        return KernelChoice("fla")
    return KernelChoice("fla (delta rule; conv in torch: this fla has no varlen conv)")


def kernel_choices(on_cuda: bool, engine: str, use_remove_padding: bool = True) -> dict[str, KernelChoice]:
    """``{part: KernelChoice}`` of the Gated DeltaNet layers as ``engine`` runs them."""
    choices = {"gated_deltanet": _gdn_choice(on_cuda)}
    # Padded forwards (use_remove_padding=false) are transformers' own, with its own conv kernel. Packed forwards
    # and the hf rollout's decode runner (packed prefill, its own conv step) never call it.
    if engine == "fsdp" and not use_remove_padding:
        ok = shared.importable("causal_conv1d")
        choices["stock_gdn_conv"] = KernelChoice("causal-conv1d" if ok else "torch", slow=on_cuda and not ok,
                                                 kernel="causal_conv1d")
    return choices
