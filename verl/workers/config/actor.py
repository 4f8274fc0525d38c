"""The actor's config dataclasses (upstream's ``verl.workers.config`` names), generated from the YAML.

The trainer's YAML (``verl/trainer/config/actor/*.yaml``) is the one place where actor keys and defaults
live: the fields of :class:`ActorConfig` and :class:`PolicyLossConfig` are read from it when this module is
imported, so a key added there is a field here, with the same default. :func:`actor_config_from_omegaconf`
turns the composed (Hydra) actor section into the dataclass that policy losses receive as ``config``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from verl.workers.config.base import BaseConfig

__all__ = ["ActorConfig", "FSDPActorConfig", "McoreActorConfig", "PolicyLossConfig", "actor_config_from_omegaconf"]

_ACTOR_DIR = Path(__file__).resolve().parents[2] / "trainer" / "config" / "actor"


def _yaml(name: str) -> dict:
    raw = OmegaConf.load(_ACTOR_DIR / name)
    data = OmegaConf.to_container(raw, resolve=False)
    data.pop("defaults", None)
    return data


def _default(value):
    # Interpolations (``${oc.select:...}``) and ``???`` only mean something in the composed config.
    if isinstance(value, str) and (value.startswith("${") or value == "???"):
        return None
    return value


def _fields(section: dict, skip: tuple = ()) -> list[tuple]:
    out = []
    for key, value in section.items():
        if key in skip:
            continue
        value = _default(value)
        if isinstance(value, (dict, list)):
            out.append((key, type(value), dataclasses.field(default_factory=lambda v=value: _copy(v))))
        else:
            out.append((key, Any if value is None else type(value), dataclasses.field(default=value)))
    return out


def _copy(value):
    import copy

    return copy.deepcopy(value)


def _extra_attribute(self, name: str):
    # Only reached for names that are not fields: sections composed in from other files (optim, ...).
    extra = self.__dict__.get("extra")
    if extra is not None and name in extra:
        return extra[name]
    raise AttributeError(f"{type(self).__name__} has no field {name!r}")


_BASE = _yaml("actor.yaml")
_FSDP = _yaml("dp_actor.yaml")
_MCORE = _yaml("megatron_actor.yaml")

PolicyLossConfig = dataclasses.make_dataclass(
    "PolicyLossConfig",
    _fields(_BASE["policy_loss"]) + [("rollout_correction", Optional[dict], dataclasses.field(default=None))],
    bases=(BaseConfig,))
PolicyLossConfig.__doc__ = ("Policy-loss knobs (actor.policy_loss.*): loss_mode and the mode-specific settings; "
                            "rollout_correction is set in rollout-correction bypass mode.")

ActorConfig = dataclasses.make_dataclass(
    "ActorConfig",
    _fields(_BASE, skip=("policy_loss",))
    + [("policy_loss", PolicyLossConfig, dataclasses.field(default_factory=PolicyLossConfig)),
       # Token / sequence counts of the whole mini-batch over data-parallel ranks, filled per mini-batch.
       ("global_batch_info", dict, dataclasses.field(default_factory=dict)),
       # Keys of the composed config that the YAML defaults do not declare (kept, never dropped).
       ("extra", dict, dataclasses.field(default_factory=dict))],
    bases=(BaseConfig,), namespace={"__getattr__": _extra_attribute})
ActorConfig._mutable_fields = frozenset({"global_batch_info"})
ActorConfig.__doc__ = "The actor section (actor_rollout_ref.actor.*) as custom policy losses receive it."

FSDPActorConfig = dataclasses.make_dataclass(
    "FSDPActorConfig", [f for f in _fields(_FSDP) if f[0] not in _BASE], bases=(ActorConfig,))
FSDPActorConfig.__doc__ = "ActorConfig plus the FSDP actor's keys (strategy fsdp / fsdp2)."

McoreActorConfig = dataclasses.make_dataclass(
    "McoreActorConfig", [f for f in _fields(_MCORE) if f[0] not in _BASE], bases=(ActorConfig,))
McoreActorConfig.__doc__ = "ActorConfig plus the Megatron actor's keys (strategy megatron)."


for _cls in (PolicyLossConfig, ActorConfig, FSDPActorConfig, McoreActorConfig):
    _cls.__module__ = __name__  # pickling (Ray) finds the classes here


def _class_for(strategy) -> type:
    return McoreActorConfig if strategy == "megatron" else FSDPActorConfig if strategy in ("fsdp", "fsdp2") \
        else ActorConfig


def actor_config_from_omegaconf(cfg, global_batch_info: Optional[dict] = None) -> "ActorConfig":
    """The composed actor section (DictConfig or dict) as the dataclass for its strategy."""
    data = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    cls = _class_for(data.get("strategy"))
    names = {f.name for f in dataclasses.fields(cls)}
    known = {k: v for k, v in data.items() if k in names and k not in ("policy_loss", "extra")}
    extra = {k: v for k, v in data.items() if k not in names}
    pl = dict(data.get("policy_loss") or {})
    pl_names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    unknown_pl = sorted(set(pl) - pl_names)
    if unknown_pl:
        raise ValueError(f"actor.policy_loss has keys {unknown_pl} that PolicyLossConfig does not declare; add them "
                         "to verl/trainer/config/actor/actor.yaml")
    return cls(**known, policy_loss=PolicyLossConfig(**pl), global_batch_info=dict(global_batch_info or {}),
               extra=extra)
