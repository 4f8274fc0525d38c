"""The door through which ground-floor utilities read model knowledge without importing :mod:`verl.models`.

``verl.utils`` may not import models (it is the ground floor every other package stands on), yet a few of its
helpers answer per-model questions (the FLOPs formula of a config, the oldest vLLM-Ascend release a model runs
on). :mod:`verl.models.spec` hands its lookup (``get_model_spec``) to :func:`set_model_spec_lookup` when it is
imported; those helpers ask :func:`model_spec_of`. Before that (no model package imported) there is no answer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["model_spec_of", "set_model_spec_lookup"]

_lookup: Optional[Callable[[Any], Any]] = None


def set_model_spec_lookup(lookup: Callable[[Any], Any]) -> None:
    """Install ``lookup(hf_config) -> ModelSpec`` (verl.models.spec does, on import)."""
    global _lookup
    _lookup = lookup


def model_spec_of(hf_config) -> Optional[Any]:
    """The model spec of ``hf_config`` (a :class:`verl.models.spec.ModelSpec`), or None when no lookup is set."""
    return None if _lookup is None else _lookup(hf_config)
