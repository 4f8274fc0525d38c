"""Training-engine config dataclasses (upstream's names), generated from ``verl/trainer/config/engine/*.yaml``.

``EngineConfig`` holds the keys both engine YAMLs share with one default; ``FSDPEngineConfig`` (the actor's
``fsdp_config``) and ``McoreEngineConfig`` (its ``megatron`` section) add each engine's own.
"""

from __future__ import annotations

from verl.workers.config._generate import load_yaml, make_config, split_family, yaml_defaults

__all__ = ["EngineConfig", "FSDPEngineConfig", "McoreEngineConfig"]

_common, _own = split_family({"fsdp": yaml_defaults(load_yaml("engine/fsdp.yaml")),
                              "megatron": yaml_defaults(load_yaml("engine/megatron.yaml"))})

EngineConfig = make_config("EngineConfig", _common, __name__, "Training-engine keys every engine shares.")
FSDPEngineConfig = make_config("FSDPEngineConfig", _own["fsdp"], __name__,
                               "The FSDP / FSDP2 engine section (engine/fsdp.yaml; actor.fsdp_config).",
                               bases=(EngineConfig,))
McoreEngineConfig = make_config("McoreEngineConfig", _own["megatron"], __name__,
                                "The Megatron engine section (engine/megatron.yaml; actor.megatron).",
                                bases=(EngineConfig,))
