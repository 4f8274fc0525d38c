"""Ascend NPU fused forwards: the one call site (model load) and the public names of Qwen3.5's patches.

Which forwards an architecture swaps on an NPU is its model spec's business (``ModelSpec.npu_patch``; Qwen3.5's
live in :mod:`verl.models.qwen3_5.npu_patch` and are re-exported here under their seed names).
"""

from __future__ import annotations

from verl.models.qwen3_5.npu_patch import apply_npu_patches, is_torch_npu_available, revert_npu_patches
from verl.models.spec import get_model_spec

__all__ = ["apply_npu_patches", "apply_npu_patches_for_model", "is_torch_npu_available", "revert_npu_patches"]


def apply_npu_patches_for_model(hf_config) -> list[str]:
    """Patch the config's architecture when this process runs on an Ascend NPU (``verl.utils.device``: torch_npu
    importable *and* a device visible) and its spec names NPU forwards; never otherwise. Returns what was patched."""
    from verl.utils.device import get_device_name

    if get_device_name() != "npu":
        return []
    install = get_model_spec(hf_config).resolve("npu_patch")
    return [] if install is None else install(get_model_spec(hf_config))
