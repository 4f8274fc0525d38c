"""The FSDP2 training engine (registered as ``fsdp2``; ``fsdp`` is an alias that logs one warning)."""

from .engine import FSDPEngine, warn_fsdp_alias

__all__ = ["FSDPEngine", "warn_fsdp_alias"]
