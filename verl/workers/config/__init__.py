"""Typed views of the trainer config (upstream's ``verl.workers.config``); the YAML stays the source of truth."""

from .actor import ActorConfig, FSDPActorConfig, McoreActorConfig, PolicyLossConfig, actor_config_from_omegaconf
from .base import BaseConfig

__all__ = ["ActorConfig", "BaseConfig", "FSDPActorConfig", "McoreActorConfig", "PolicyLossConfig",
           "actor_config_from_omegaconf"]
