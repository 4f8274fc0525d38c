"""Where each training engine keeps its settings inside a role section, and which of them multiply into the
ranks of one data-parallel replica: one registration per engine (``verl/workers/engine/__init__.py``), read by
the workers and by config validation so neither branches on the engine's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from verl.single_controller.dp_layout import DataParallelLayout

from verl.utils.registry import Registry

__all__ = ["ENGINE_SECTIONS", "EngineSections", "engine_section", "engine_sections", "ranks_per_dp_replica",
           "role_dp_layout"]


@dataclass(frozen=True)
class EngineSections:
    # Keys of the engine's section in a role section, first present wins (dotted: a nested section).
    engine_keys: tuple[str, ...]
    # Settings (dotted, relative to the role section) whose product is the ranks of one data-parallel replica:
    # the ranks that receive the same data.
    replica_keys: tuple[str, ...]
    # (world size, values of replica_keys in order) -> which replica each rank serves. None: blocks of
    # consecutive ranks (DataParallelLayout.blocks).
    dp_layout: Optional[Callable[[int, tuple[int, ...]], DataParallelLayout]] = None


ENGINE_SECTIONS = Registry("engine config layout", config_key="strategy")


def engine_sections(strategy: str) -> EngineSections:
    from verl.workers.engine.base import EngineRegistry

    return ENGINE_SECTIONS.get_or_raise(EngineRegistry.canonical(str(strategy or "fsdp2")))


def _select(section: Any, dotted: str) -> Any:
    node = section
    for part in dotted.split("."):
        if node is None:
            return None
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return node


def _replica_sizes(role_cfg) -> tuple[int, ...]:
    return tuple(int(_select(role_cfg, key) or 1)
                 for key in engine_sections(_select(role_cfg, "strategy")).replica_keys)


def ranks_per_dp_replica(role_cfg) -> int:
    """Ranks that receive the same data: a Ulysses group (FSDP) or one model-parallel replica (Megatron:
    tensor * pipeline * context parallel). Where they sit is :func:`role_dp_layout`'s answer."""
    size = 1
    for v in _replica_sizes(role_cfg):
        size *= v
    return size


def role_dp_layout(role_cfg, world_size: int) -> DataParallelLayout:
    """Which data-parallel replica each of ``world_size`` ranks serves for a role section (``strategy`` picks the
    engine's registered layout): the worker group dispatches by it, and the workers read their replica from it."""
    sections = engine_sections(_select(role_cfg, "strategy"))
    sizes = _replica_sizes(role_cfg)
    if sections.dp_layout is not None:
        return sections.dp_layout(world_size, sizes)
    replica = ranks_per_dp_replica(role_cfg)
    if world_size % replica:
        raise ValueError(f"{' * '.join(sections.replica_keys)} ({replica}) must divide the world size ({world_size})")
    return DataParallelLayout.blocks(world_size, world_size // replica)


def engine_section(role_cfg, strategy: str):
    """The engine_config of a role (e.g. ``critic.fsdp`` for the critic on FSDP, ``<role>.megatron``)."""
    from omegaconf import OmegaConf

    for key in engine_sections(strategy).engine_keys:
        found = _select(role_cfg, key)
        if found is not None:
            return found
    return OmegaConf.create({})
