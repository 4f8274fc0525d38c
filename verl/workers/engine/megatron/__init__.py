"""The Megatron-Core training engine (``strategy=megatron``).

megatron-core is an optional extra (Python 3.12 + CUDA): this package imports it only when the engine class
is asked for, so its CPU-side parts (settings, packing, vocab-parallel statistics) import anywhere and
``EngineRegistry.get_or_raise("megatron")`` fails with an error that names the ``mcore`` extra.
"""

from __future__ import annotations

from .settings import MIN_MCORE_VERSION, require_mcore

__all__ = ["MegatronEngine", "require_mcore", "MIN_MCORE_VERSION"]


def __getattr__(name: str):
    if name == "MegatronEngine":
        require_mcore()
        from .engine import MegatronEngine

        return MegatronEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
