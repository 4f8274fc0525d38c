"""Semantic validation of a composed trainer config.

``validate_config`` runs before any worker starts. It gathers every problem it finds and
raises one :class:`ConfigValidationError` listing all of them, each naming the key to
change and how; soft issues are emitted as :class:`ConfigWarning`.
The batch-size rules mirror the ones upstream verl enforces in its trainer and config
dataclasses, so a config that passes here will not trip them later.

The rules live in :mod:`.role_checks` (trainer, data, actor, rollout, reference, critic) and
:mod:`.algo_checks` (algorithm, reward, recipes, left-out features); :mod:`.checker` holds the
reading / reporting machinery and the live-registry lookups they share.
"""

from __future__ import annotations

import warnings

from omegaconf import DictConfig

from . import algo_checks, role_checks
from .checker import (
    Checker,
    ConfigValidationError,
    ConfigWarning,
    compute_world_size,
    need_critic,
    need_reference_policy,
)

__all__ = [
    "ConfigValidationError",
    "ConfigWarning",
    "compute_world_size",
    "need_critic",
    "need_reference_policy",
    "validate_config",
]


def validate_config(cfg: DictConfig) -> None:
    """Check a composed trainer config; raise :class:`ConfigValidationError` listing every problem.

    Soft issues (e.g. KL applied both in the reward and in the loss) are reported with
    ``warnings.warn(..., ConfigWarning)`` and do not fail validation.
    """
    c = Checker(cfg)
    world = role_checks.check_trainer(c)
    role_checks.check_data(c)
    role_checks.check_model(c, "actor_rollout_ref.model")
    algo_checks.check_algorithm(c)
    role_checks.check_actor(c, world)
    role_checks.check_ref(c, world)
    role_checks.check_rollout(c, world)
    role_checks.check_router_replay(c)
    role_checks.check_critic(c, world)
    algo_checks.check_megatron(c)
    algo_checks.check_reward(c)
    algo_checks.check_distillation(c)
    algo_checks.check_out_of_scope(c)
    algo_checks.check_profiler(c)
    algo_checks.check_key_status(c)
    algo_checks.check_recipes(c)
    algo_checks.check_owned_settings(c)
    for note in c.notes:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    if c.problems:
        # The same key can be reached from two rules; report it once.
        raise ConfigValidationError(dict.fromkeys(c.problems))
