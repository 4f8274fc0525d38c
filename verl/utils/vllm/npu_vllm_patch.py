"""vLLM patches applied on Ascend NPU only (vLLM-Ascend), with an explicit supported-version window.

The patches here touch vLLM internals whose shape changes between releases, so they are applied only to
the releases they were written against; outside that window :func:`apply_npu_vllm_patches` stops with a
message naming the installed and the supported versions instead of patching blindly.

* FusedMoE weight loader: vLLM-Ascend post-processes expert weights into a transposed runtime layout
  (see :mod:`verl.utils.vllm.ascend_moe`). A later reload through the loader would then write checkpoint
  shards into transposed parameters; the wrapper first restores the checkpoint layout so the loader works,
  and flags the layer for post-processing again.
* ``VLLM_ASCEND_ENABLE_NZ`` must be ``0`` for sleep / wake-up (checked when the rollout is created).
"""

from __future__ import annotations

import functools
import logging

from .ascend_moe import CHECKPOINT, RUNTIME

logger = logging.getLogger(__name__)

# [min, max): the vLLM releases these patches were written and checked against. 0.13 is the first with
# vLLM-Ascend's FusedMoE loader interface used below. A model may need a later release: its model spec's
# ``min_vllm_ascend`` (Qwen3.5: 0.18.0) is checked too.
SUPPORTED_VLLM_RANGE = ("0.13.0", "0.19.0")
_PATCHED_MARK = "_verl_npu_moe_loader_patched"


class UnsupportedVllmVersion(RuntimeError):
    pass


def _version(v: str):
    from packaging.version import Version

    return Version(Version(v).base_version)  # 0.18.0rc1 / 0.18.0+ascend count as 0.18.0


def check_vllm_version(vllm_version: str, hf_config=None) -> None:
    """Raise :class:`UnsupportedVllmVersion` when ``vllm_version`` is outside the supported window, or older
    than what ``hf_config``'s model spec needs on Ascend (``ModelSpec.min_vllm_ascend``)."""
    lo, hi = SUPPORTED_VLLM_RANGE
    v = _version(vllm_version)
    if not (_version(lo) <= v < _version(hi)):
        raise UnsupportedVllmVersion(
            f"verl's vLLM-Ascend patches support vllm>={lo},<{hi}; found vllm {vllm_version}. Install the "
            f"pinned NPU stack (requirements-npu.txt: vllm / vllm-ascend 0.18.0 with torch / torch_npu 2.9.0)."
        )
    if hf_config is None:
        return
    from verl.utils.model_specs import model_spec_of

    spec = model_spec_of(hf_config)
    if spec is not None and spec.min_vllm_ascend and v < _version(spec.min_vllm_ascend):
        raise UnsupportedVllmVersion(
            f"{spec.architecture} on Ascend needs vllm>={spec.min_vllm_ascend} (with the matching vllm-ascend); "
            f"found vllm {vllm_version}."
        )


def wrap_fused_moe_loader(loader, hidden_size_attr: str = "hidden_size"):
    """Wrap ``FusedMoE.weight_loader`` so checkpoint shards can be loaded into post-processed layers."""
    if getattr(loader, _PATCHED_MARK, False):
        return loader

    @functools.wraps(loader)
    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
        hidden = getattr(self, hidden_size_attr)
        # Runtime layout puts H in dim 1 of w13 ([E, H, 2I]) and dim 2 of w2 ([E, I, H]).
        runtime = (shard_id in ("w1", "w3") and param.shape[1] == hidden and param.shape[2] != hidden) or (
            shard_id == "w2" and param.shape[2] == hidden and param.shape[1] != hidden
        )
        if runtime:
            param.data = param.data.transpose(1, 2).contiguous()
            self._verl_moe_layout = CHECKPOINT
            self._verl_skip_post_process = False
        return loader(self, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)

    setattr(weight_loader, _PATCHED_MARK, True)
    return weight_loader


def patch_fused_moe_class(fused_moe_cls) -> bool:
    """Install :func:`wrap_fused_moe_loader` on a FusedMoE *class*; False if it is not a patchable class."""
    loader = getattr(fused_moe_cls, "weight_loader", None)
    if not isinstance(fused_moe_cls, type) or not callable(loader):
        return False
    fused_moe_cls.weight_loader = wrap_fused_moe_loader(loader)
    return True


def is_npu_available() -> bool:
    try:
        import torch
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def apply_npu_vllm_patches(hf_config=None, *, force: bool = False) -> bool:
    """Apply the NPU patches before the engine for ``hf_config``'s model is created; returns whether anything
    was patched.

    No-op (False) off NPU unless ``force`` (used by tests with fake modules).
    """
    if not force and not is_npu_available():
        return False
    try:
        import vllm
        from vllm.model_executor.layers import fused_moe
    except ImportError as e:
        raise ImportError(f"vLLM is required on NPU ({e}); install requirements-npu.txt") from e
    check_vllm_version(vllm.__version__, hf_config)
    patched = patch_fused_moe_class(getattr(fused_moe, "FusedMoE", None))
    logger.info("vLLM-Ascend FusedMoE loader patch %s", "applied" if patched else "not applicable")
    return patched


__all__ = [
    "RUNTIME",
    "SUPPORTED_VLLM_RANGE",
    "UnsupportedVllmVersion",
    "apply_npu_vllm_patches",
    "check_vllm_version",
    "patch_fused_moe_class",
    "wrap_fused_moe_loader",
]
