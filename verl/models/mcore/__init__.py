"""Megatron-core backend, model-independent part (megatron-core >= 0.18): the registry of per-architecture builders
(:mod:`.registry`), the shared config half (:mod:`.config_converter`), weight loading helpers
(:mod:`.weight_loading`) and the generic GPT checkpoint loader/saver (:mod:`.gpt_checkpoint`).

Importing this package needs no megatron. Each architecture's megatron-core model lives in its own package
(e.g. ``verl/models/qwen3_5/mcore/``) and is reached through the registry, which calls :func:`require_megatron`
first.
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
