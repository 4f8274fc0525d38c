"""The project's vLLM plugin: what vLLM must know to run the architectures this project supports.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (the engine core, its workers)
before it resolves a model; ``setup.py`` declares :func:`register` there, so an engine started in a separate
process (vLLM's multiprocessing engine, a server) finds the registrations too. The colocated engine also
calls :func:`register` itself before starting, which covers a source checkout that was never
``pip install``-ed. Which registrations exist is the model specs' business (``ModelSpec.vllm_registration``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "verl_models"
_done = False


def registration_functions() -> list:
    """The distinct registration functions named by the registered model specs, in registration order."""
    from verl.models.registry import SUPPORTED_ARCHITECTURES

    seen, out = set(), []
    for spec in SUPPORTED_ARCHITECTURES.values():
        path = getattr(spec, "vllm_registration", None)
        if path and path not in seen:
            seen.add(path)
            out.append(spec.resolve("vllm_registration"))
    return out


def register() -> None:
    """vLLM general-plugin entry point; idempotent within a process."""
    global _done
    if _done:
        return
    for fn in registration_functions():
        added = fn()
        if added:
            logger.info("registered with vLLM: %s", ", ".join(added))
    _done = True



def entry_point_installed() -> bool:
    """Whether the installed ``verl`` distribution declares this plugin (False for a source checkout on
    ``PYTHONPATH``: vLLM processes other than this one then miss the registrations)."""
    from importlib.metadata import entry_points

    return any(ep.name == ENTRY_POINT_NAME and ep.value.startswith(__name__)
               for ep in entry_points(group=ENTRY_POINT_GROUP))
