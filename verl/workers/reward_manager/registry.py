"""Name -> reward manager class, so configs can pick a manager by ``reward.reward_manager.name``."""

from __future__ import annotations

from typing import Callable

from verl.utils.registry import Registry

__all__ = ["REWARD_MANAGER_REGISTRY", "register", "get_reward_manager_cls"]

REWARD_MANAGER_REGISTRY = Registry("reward manager", config_key="reward.reward_manager.name")


def register(name: str, *, override: bool = False) -> Callable[[type], type]:
    """Class decorator registering a reward manager under ``name``.

    Re-registering the same class (or its twin from a reloaded module) is a no-op; a different class under
    a taken name is an error unless ``override=True``, since silently replacing it would change which
    manager a config gets.
    """
    return REWARD_MANAGER_REGISTRY.register(name, override=override)


def get_reward_manager_cls(name: str) -> type:
    """The class registered under ``name``; an unknown name lists the registered ones."""
    return REWARD_MANAGER_REGISTRY.get_or_raise(name)
