"""Reward managers: turn a batch of rollouts into token-level scores."""

from .registry import get_reward_manager_cls, register  # noqa: I001  (registry first: managers use it)
from .naive import NaiveRewardManager
from .dapo import DAPORewardManager
from .gdpo import GDPORewardManager

__all__ = ["DAPORewardManager", "GDPORewardManager", "NaiveRewardManager", "get_reward_manager_cls", "register"]
