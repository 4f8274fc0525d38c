"""Trainer configuration: Hydra YAML files in this folder plus key / value checks.

``ppo_trainer.yaml`` and ``ppo_megatron_trainer.yaml`` are the entry configs; the
sub-folders are Hydra config groups they compose. See :mod:`verl.trainer.config.checks`.
"""

from .checks import (
    CONFIG_DIR,
    ConfigKeyError,
    ConfigValidationError,
    ConfigWarning,
    check_overrides,
    compose_config,
    compute_world_size,
    need_critic,
    need_reference_policy,
    validate_config,
)

__all__ = [
    "CONFIG_DIR",
    "ConfigKeyError",
    "ConfigValidationError",
    "ConfigWarning",
    "check_overrides",
    "compose_config",
    "compute_world_size",
    "need_critic",
    "need_reference_policy",
    "validate_config",
]
