"""``model.external_lib`` (upstream's key): modules imported before a model is built.

Such a module registers what a custom model needs with the libraries that build it: its config and model
classes with transformers' Auto classes, its rollout weight loader with
:mod:`verl.models.dtensor_weight_loader`. Every process that builds a model or a rollout engine imports it
first: the FSDP and Megatron engines (trainer workers) and the vLLM rollout server process, which does not
inherit the trainer's imports (it is spawned).
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

__all__ = ["import_external_lib"]


def import_external_lib(model_cfg) -> None:
    """Import the module(s) named in ``model_cfg.external_lib`` (a name or a list of names); None/"" is a
    no-op. A module that cannot be imported is an ImportError naming the key."""
    libs = model_cfg.get("external_lib") if model_cfg is not None else None
    if not libs:
        return
    for name in [libs] if isinstance(libs, str) else list(libs):
        try:
            importlib.import_module(str(name))
        except ImportError as exc:
            raise ImportError(f"model.external_lib={name!r} could not be imported ({exc}); install it or fix the "
                              "module name") from exc
        logger.info("imported model.external_lib %s", name)
