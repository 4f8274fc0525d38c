"""Reading and checking upstream's profiler keys.

``global_profiler.{tool, steps, profile_continuous_steps, save_path}`` choose the tool and the steps;
``<role>.profiler.{enable, all_ranks, ranks, tool_config.torch.contents}`` choose who is traced, for the
roles actor_rollout_ref.{actor, ref, rollout} (one worker group: "actor_rollout") and critic.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from omegaconf import OmegaConf

from verl.utils.config import to_plain

__all__ = ["BUILT_TOOLS", "WorkerProfileSpec", "ProfilePlan", "check_profiler_config"]

BUILT_TOOLS = ("torch",)
# Upstream's other tools, named in the refusal.
_OTHER_TOOLS = {
    "nsys": "NVIDIA Nsight Systems",
    "npu": "the Ascend NPU profiler",
    "torch_memory": "torch memory snapshots",
    "precision_debugger": "msprobe's precision debugger",
}
TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")

# worker group -> the config sections of the roles it runs
GROUP_ROLES = {
    "actor_rollout": ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout"),
    "critic": ("critic",),
}


def _select(cfg, key: str, default=None):
    """A dotted ``key`` (``"global_profiler.tool"``): a path, which :func:`verl.utils.config.cfg_get` does not walk."""
    return to_plain(OmegaConf.select(cfg, key, default=default))


@dataclasses.dataclass
class WorkerProfileSpec:
    """What one worker group traces; sent to the workers (plain data, so Ray can pickle it)."""

    group: str
    save_path: str
    all_ranks: bool
    ranks: list[int]
    contents: list[str]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ProfilePlan:
    tool: Optional[str]
    steps: list[int]
    continuous: bool
    workers: dict[str, WorkerProfileSpec]

    @classmethod
    def from_config(cls, cfg) -> "ProfilePlan":
        tool = _select(cfg, "global_profiler.tool")
        steps = [int(s) for s in (_select(cfg, "global_profiler.steps") or [])]
        continuous = bool(_select(cfg, "global_profiler.profile_continuous_steps", False))
        default_path = _select(cfg, "global_profiler.save_path") or "outputs/profile"
        workers = {}
        for group, sections in GROUP_ROLES.items():
            enabled = [s for s in sections if _select(cfg, f"{s}.profiler.enable", False)]
            if not enabled:
                continue
            ranks: set[int] = set()
            contents: list[str] = []
            for s in enabled:
                ranks.update(int(r) for r in (_select(cfg, f"{s}.profiler.ranks") or []))
                for item in _select(cfg, f"{s}.profiler.tool_config.torch.contents") or []:
                    if item not in contents:
                        contents.append(item)
            workers[group] = WorkerProfileSpec(
                group=group,
                save_path=str(_select(cfg, f"{enabled[0]}.profiler.save_path") or default_path),
                all_ranks=any(_select(cfg, f"{s}.profiler.all_ranks", False) for s in enabled),
                ranks=sorted(ranks),
                contents=contents,
            )
        return cls(tool=tool, steps=steps, continuous=continuous, workers=workers)

    @property
    def active(self) -> bool:
        return self.tool == "torch" and bool(self.steps) and bool(self.workers)


def _tool_problem(key: str, tool: Any) -> Optional[str]:
    if tool is None or tool in BUILT_TOOLS:
        return None
    if tool in _OTHER_TOOLS:
        return (f"`{key}` is {tool!r} ({_OTHER_TOOLS[tool]}), which this project does not build; "
                f"use {key}=torch (torch.profiler traces) or null.")
    return f"`{key}` is {tool!r}; the only profiler built here is torch (upstream also has {', '.join(_OTHER_TOOLS)})."


def check_profiler_config(cfg) -> list[str]:
    """One message per problem in the profiler keys (validation collects them)."""
    problems: list[str] = []
    tool = _select(cfg, "global_profiler.tool")
    msg = _tool_problem("global_profiler.tool", tool)
    if msg:
        problems.append(msg)
    steps = _select(cfg, "global_profiler.steps")
    if steps is not None and (not isinstance(steps, list)
                              or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps)):
        problems.append(f"`global_profiler.steps` is {steps!r}; give a list of global steps (from 1), e.g. [2,5].")
    any_enabled = False
    for sections in GROUP_ROLES.values():
        for s in sections:
            if OmegaConf.select(cfg, f"{s}.profiler", default=None) is None:
                continue
            role_tool = _select(cfg, f"{s}.profiler.tool")
            if role_tool != tool:
                msg = _tool_problem(f"{s}.profiler.tool", role_tool)
                if msg:
                    problems.append(msg)
                elif role_tool is not None:
                    problems.append(f"`{s}.profiler.tool` is {role_tool!r} but global_profiler.tool is {tool!r}; "
                                    "set the tool once, in global_profiler.tool.")
            if not _select(cfg, f"{s}.profiler.enable", False):
                continue
            any_enabled = True
            torch_cfg = f"{s}.profiler.tool_config.torch"
            contents = _select(cfg, f"{torch_cfg}.contents") or []
            bad = [c for c in contents if c not in TORCH_CONTENTS]
            if bad:
                problems.append(f"`{torch_cfg}.contents` has {bad}; allowed: {', '.join(TORCH_CONTENTS)}.")
            if _select(cfg, f"{torch_cfg}.discrete", False):
                problems.append(f"`{torch_cfg}.discrete` is true (one trace per task), which is not built here; "
                                "set it to false for one trace per step.")
            schedule = _select(cfg, f"{torch_cfg}.schedule") or {}
            if any(v for v in schedule.values()):
                problems.append(f"`{torch_cfg}.schedule` is {schedule}; an in-step torch.profiler schedule is "
                                "not built here: choose steps with global_profiler.steps and leave it all 0.")
            ranks = _select(cfg, f"{s}.profiler.ranks") or []
            if not _select(cfg, f"{s}.profiler.all_ranks", False) and not ranks:
                problems.append(f"`{s}.profiler.enable` is true but no rank is chosen; set "
                                f"{s}.profiler.all_ranks=true or {s}.profiler.ranks=[0].")
    if any_enabled and tool is None:
        problems.append("`global_profiler.tool` is null but a role's profiler.enable is true; set "
                        "global_profiler.tool=torch and global_profiler.steps.")
    if any_enabled and tool in BUILT_TOOLS and not steps:
        problems.append("`global_profiler.steps` is empty, so nothing would be profiled; list the steps, e.g. [1].")
    return problems
