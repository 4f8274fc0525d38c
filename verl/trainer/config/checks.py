"""Public entry points for trainer-config checking.

Typical use in a launcher::

    cfg = compose_config("ppo_trainer", sys.argv[1:])   # checks keys, composes, validates

or, step by step, ``check_overrides(base_cfg, overrides)`` before Hydra applies the
overrides and ``validate_config(cfg)`` on the final config.
"""

from __future__ import annotations

import warnings

from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from .overrides import (
    CONFIG_DIR,
    OPEN_DICT_PATTERNS,
    ConfigKeyError,
    check_overrides,
    config_key_paths,
    normalize_overrides,
    settle_sequence_parallel,
    hoist_engine_choice,
    split_overrides,
    upstream_only_keys,
)
from .validate import (
    ConfigValidationError,
    ConfigWarning,
    compute_world_size,
    need_critic,
    need_reference_policy,
    validate_config,
)

__all__ = [
    "CONFIG_DIR",
    "OPEN_DICT_PATTERNS",
    "ConfigKeyError",
    "ConfigValidationError",
    "ConfigWarning",
    "check_overrides",
    "compose_config",
    "compute_world_size",
    "config_key_paths",
    "need_critic",
    "need_reference_policy",
    "split_overrides",
    "upstream_only_keys",
    "validate_config",
]


def compose_config(
    config_name: str = "ppo_trainer",
    overrides: Sequence[str] = (),
    config_dir: Optional[Path] = None,
    validate: bool = True,
) -> DictConfig:
    """Compose ``config_name`` with ``overrides`` after checking every override key.

    Group choices (``model_engine=megatron``) are applied to the base config first, so
    engine-specific keys are checked against the right variant.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = Path(config_dir) if config_dir is not None else CONFIG_DIR
    overrides = hoist_engine_choice(overrides)
    group_overrides, _ = split_overrides(overrides, config_dir)
    if config_dir.resolve() != CONFIG_DIR and not any(o.lstrip("+~").startswith("hydra.searchpath") for o in overrides):
        # Configs in a user's --config-path build on this folder (`defaults: [ppo_trainer, ...]`).
        search = f"hydra.searchpath=[file://{CONFIG_DIR}]"
        overrides.append(search)
        group_overrides.append(search)

    def _compose() -> DictConfig:
        base = compose(config_name=config_name, overrides=group_overrides)
        normalized, notes = normalize_overrides(base, overrides, config_dir=config_dir)
        for note in notes:
            warnings.warn(note, ConfigWarning, stacklevel=3)
        check_overrides(base, normalized, config_dir=config_dir)
        return compose(config_name=config_name, overrides=normalized)

    if GlobalHydra.instance().is_initialized():
        cfg = _compose()  # already inside a Hydra app: reuse its search path
    else:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = _compose()
    settle_sequence_parallel(cfg)
    from .lora_section import settle_lora_section

    settle_lora_section(cfg)
    if validate:
        validate_config(cfg)
    return cfg
