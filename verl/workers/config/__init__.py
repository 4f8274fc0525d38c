"""Typed views of the trainer config (upstream's ``verl.workers.config``); the YAML stays the source of truth."""

from .actor import ActorConfig, FSDPActorConfig, McoreActorConfig, PolicyLossConfig, actor_config_from_omegaconf
from .base import BaseConfig
from .checkpoint import CheckpointConfig, McoreCheckpointConfig, ProfilerConfig
from .engine import EngineConfig, FSDPEngineConfig, McoreEngineConfig
from .optimizer import FSDPOptimizerConfig, McoreOptimizerConfig, OptimizerConfig

__all__ = ["ActorConfig", "BaseConfig", "CheckpointConfig", "EngineConfig", "FSDPActorConfig", "FSDPEngineConfig",
           "FSDPOptimizerConfig", "McoreActorConfig", "McoreCheckpointConfig", "McoreEngineConfig",
           "McoreOptimizerConfig", "OptimizerConfig", "PolicyLossConfig", "ProfilerConfig",
           "actor_config_from_omegaconf"]
