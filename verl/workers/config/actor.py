"""The actor's config dataclasses (upstream's ``verl.workers.config`` names), generated from the YAML.

The trainer's YAML (``verl/trainer/config/actor/*.yaml``) is the one place where actor keys and defaults
live: the fields of :class:`ActorConfig` and :class:`PolicyLossConfig` are read from it when this module is
imported, so a key added there is a field here, with the same default. Nested sections are typed as upstream
types them (``optim``: OptimizerConfig, ``checkpoint``: CheckpointConfig, ``profiler``: ProfilerConfig,
``fsdp_config``: FSDPEngineConfig, ``megatron``: McoreEngineConfig), each generated from its own YAML.
:func:`actor_config_from_omegaconf` turns the composed (Hydra) actor section into the dataclass that policy
losses receive as ``config``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from omegaconf import OmegaConf

from verl.workers.config._generate import build, load_yaml, make_config, yaml_defaults
from verl.workers.config.checkpoint import CheckpointConfig, McoreCheckpointConfig, ProfilerConfig
from verl.workers.config.engine import FSDPEngineConfig, McoreEngineConfig
from verl.workers.config.optimizer import FSDPOptimizerConfig, McoreOptimizerConfig, OptimizerConfig

__all__ = ["ActorConfig", "FSDPActorConfig", "McoreActorConfig", "PolicyLossConfig", "actor_config_from_omegaconf"]


def _extra_attribute(self, name: str):
    # Only reached for names that are not fields: composed keys the YAML defaults do not declare.
    extra = self.__dict__.get("extra")
    if extra is not None and name in extra:
        return extra[name]
    raise AttributeError(f"{type(self).__name__} has no field {name!r}")


_BASE = yaml_defaults(load_yaml("actor/actor.yaml"))
_FSDP = yaml_defaults(load_yaml("actor/dp_actor.yaml"))
_MCORE = yaml_defaults(load_yaml("actor/megatron_actor.yaml"))

PolicyLossConfig = make_config(
    "PolicyLossConfig", _BASE["policy_loss"], __name__,
    "Policy-loss knobs (actor.policy_loss.*): loss_mode and the mode-specific settings; rollout_correction is "
    "set in rollout-correction bypass mode.",
    extra_fields=(("rollout_correction", Optional[dict], dataclasses.field(default=None)),))

ActorConfig = make_config(
    "ActorConfig", _BASE, __name__, "The actor section (actor_rollout_ref.actor.*) as custom policy losses receive it.",
    sections={"policy_loss": PolicyLossConfig, "checkpoint": CheckpointConfig, "profiler": ProfilerConfig,
              "optim": OptimizerConfig},
    extra_fields=(
        # Token / sequence counts of the whole mini-batch over data-parallel ranks, filled per mini-batch.
        ("global_batch_info", dict, dataclasses.field(default_factory=dict)),
        # Keys of the composed config that the YAML defaults do not declare (kept, never dropped).
        ("extra", dict, dataclasses.field(default_factory=dict))),
    namespace={"__getattr__": _extra_attribute})
ActorConfig._mutable_fields = frozenset({"global_batch_info"})

# The engine files' own keys, plus the base keys they override (checkpoint / optim change type).
FSDPActorConfig = make_config(
    "FSDPActorConfig", {k: v for k, v in _FSDP.items() if k not in _BASE}, __name__,
    "ActorConfig plus the FSDP actor's keys (strategy fsdp / fsdp2).", bases=(ActorConfig,),
    sections={"fsdp_config": FSDPEngineConfig, "optim": FSDPOptimizerConfig})

McoreActorConfig = make_config(
    "McoreActorConfig", {k: v for k, v in _MCORE.items() if k not in _BASE and k != "checkpoint"}, __name__,
    "ActorConfig plus the Megatron actor's keys (strategy megatron).", bases=(ActorConfig,),
    sections={"megatron": McoreEngineConfig, "optim": McoreOptimizerConfig, "checkpoint": McoreCheckpointConfig})


def _class_for(strategy) -> type:
    return McoreActorConfig if strategy == "megatron" else FSDPActorConfig if strategy in ("fsdp", "fsdp2") \
        else ActorConfig


def actor_config_from_omegaconf(cfg, global_batch_info: Optional[dict] = None) -> "ActorConfig":
    """The composed actor section (DictConfig or dict) as the dataclass for its strategy; nested sections
    become their dataclasses (a key one of them does not declare is an error naming it)."""
    data = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    cls = _class_for(data.get("strategy"))
    names = {f.name for f in dataclasses.fields(cls)}
    known = {k: v for k, v in data.items() if k in names and k not in ("global_batch_info", "extra")}
    extra = {k: v for k, v in data.items() if k not in names}
    return build(cls, known, "actor_rollout_ref.actor", global_batch_info=dict(global_batch_info or {}), extra=extra)

