"""The one way to read a config section: ``cfg_get`` and ``to_plain``.

Config sections reach the code as OmegaConf ``DictConfig`` (Hydra), plain ``dict`` (tests, Ray-pickled
copies) or dataclasses (``verl.workers.config``); every reader goes through these two helpers so the three
behave alike. A key set to ``None`` reads as unset: Hydra's YAML writes ``null`` for "not given", so the
caller's default applies.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cfg_get", "to_plain"]


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for mappings (``DictConfig`` included), ``cfg.key`` for objects; ``default`` when the section
    is None, the key is missing, or its value is None."""
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def to_plain(value: Any) -> Any:
    """OmegaConf containers -> plain ``dict``/``list`` (resolved), so they can be splatted into keyword arguments,
    pickled by Ray or JSON-serialised; anything else is returned as is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value
