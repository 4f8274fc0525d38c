"""Optimizer config dataclasses (upstream's names), generated from ``verl/trainer/config/optim/*.yaml``.

``OptimizerConfig`` holds the keys both engines' YAMLs share with one default; ``FSDPOptimizerConfig`` and
``McoreOptimizerConfig`` add each engine's own. The actor's ``optim`` section is one of them.
"""

from __future__ import annotations

from verl.workers.config._generate import load_yaml, make_config, split_family, yaml_defaults

__all__ = ["FSDPOptimizerConfig", "McoreOptimizerConfig", "OptimizerConfig"]

_common, _own = split_family({"fsdp": yaml_defaults(load_yaml("optim/fsdp.yaml")),
                              "megatron": yaml_defaults(load_yaml("optim/megatron.yaml"))})

OptimizerConfig = make_config("OptimizerConfig", _common, __name__,
                              "Optimizer / LR-schedule keys every engine shares (actor.optim.*).")
FSDPOptimizerConfig = make_config("FSDPOptimizerConfig", _own["fsdp"], __name__,
                                  "The FSDP engine's optimizer section (optim/fsdp.yaml).", bases=(OptimizerConfig,))
McoreOptimizerConfig = make_config("McoreOptimizerConfig", _own["megatron"], __name__,
                                   "The Megatron engine's optimizer section (optim/megatron.yaml).",
                                   bases=(OptimizerConfig,))
