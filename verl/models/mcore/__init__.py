"""Megatron-core models: Qwen3.5 (dense and MoE, text and VL checkpoints) built on megatron-core >= 0.18.

Importing this package needs no megatron: the registry (:mod:`.registry`), the config converter
(:mod:`.config_converter`) and the weight converter (:mod:`.weight_converter`) are pure Python/torch. The model
modules (:mod:`.qwen3_5`) import megatron-core and are reached through the registry, which calls
:func:`require_megatron` first.
"""

from __future__ import annotations

MCORE_EXTRA = "mcore"


def require_megatron() -> None:
    """Raise an ImportError naming the extra to install when megatron-core is missing or too old."""
    try:
        import megatron.core as mcore  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"the Megatron backend needs megatron-core>=0.18 ({exc}); install it with "
            f"`pip install -e .[{MCORE_EXTRA}]` (Python 3.12, CUDA)"
        ) from exc
    version = getattr(mcore, "__version__", None)
    if version is None:
        try:
            from megatron.core.package_info import __version__ as version
        except ImportError:
            version = None
    if version is not None:
        major, minor = (int("".join(ch for ch in p if ch.isdigit()) or 0) for p in str(version).split(".")[:2])
        if (major, minor) < (0, 18):
            raise ImportError(f"megatron-core {version} is too old: the Megatron backend needs >=0.18 "
                              f"(`pip install -e .[{MCORE_EXTRA}]`)")
