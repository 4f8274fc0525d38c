"""Name -> reward manager class, so configs can pick a manager by ``reward_manager: <name>``."""

from __future__ import annotations

from typing import Callable

__all__ = ["REWARD_MANAGER_REGISTRY", "register", "get_reward_manager_cls"]

REWARD_MANAGER_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator registering a reward manager under ``name``.

    Re-registering the same class is a no-op (modules can be reloaded); a different class under a taken
    name is an error, since silently replacing it would change which manager a config gets.
    """

    def decorator(cls: type) -> type:
        taken = REWARD_MANAGER_REGISTRY.setdefault(name, cls)
        if _dotted(taken) != _dotted(cls):
            raise ValueError(
                f"Reward manager name {name!r} is already registered to {_dotted(taken)}; "
                f"cannot register {_dotted(cls)} under it too"
            )
        REWARD_MANAGER_REGISTRY[name] = cls  # a reloaded module's class replaces its stale twin
        return cls

    return decorator


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def get_reward_manager_cls(name: str) -> type:
    """The class registered under ``name``."""
    try:
        return REWARD_MANAGER_REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REWARD_MANAGER_REGISTRY)) or "none"
        raise ValueError(
            f"Unknown reward manager {name!r} (registered: {known}); import the module that registers it, "
            "or fix reward_manager in the config"
        ) from None
