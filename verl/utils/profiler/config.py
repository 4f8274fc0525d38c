"""Reading and checking upstream's profiler keys.

``global_profiler.{tool, steps, profile_continuous_steps, save_path, relocate_results}`` choose the tool and
the steps; ``<role>.profiler.{enable, all_ranks, ranks, tool_config.<tool>.*}`` choose who is traced and how,
for the roles actor_rollout_ref.{actor, ref, rollout} (one worker group: "actor_rollout") and critic.

Tools: ``torch`` (torch.profiler Chrome traces, :mod:`.torch_profile`), ``torch_memory`` (memory snapshots,
:mod:`.torch_memory`; as upstream, every worker group takes part whether or not its role sets ``enable``,
on the roles' ranks or rank 0), ``npu`` (Ascend; its options are checked, and it needs torch_npu). With
``tool_config.{torch,npu}.discrete`` a role is traced per task instead of per step (:mod:`.step_recorder`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

from omegaconf import OmegaConf

from verl.utils.config import to_plain

__all__ = ["BUILT_TOOLS", "WorkerProfileSpec", "ProfilePlan", "check_profiler_config"]

BUILT_TOOLS = ("torch", "torch_memory", "npu")  # npu: where torch_npu is installed (validation checks)
# Upstream's other tools, named in the refusal.
_OTHER_TOOLS = {
    "nsys": "NVIDIA Nsight Systems",
    "precision_debugger": "msprobe's precision debugger",
}
TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")
NPU_CONTENTS = ("npu", "cpu", "memory", "shapes", "module", "stack")
NPU_LEVELS = ("level_none", "level0", "level1", "level2")
MEMORY_CONTEXTS = ("alloc", "state", "all")
MEMORY_STACKS = ("python", "all")

# worker group -> the config sections of the roles it runs
GROUP_ROLES = {
    "actor_rollout": ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout"),
    "critic": ("critic",),
}


def role_name(section: str) -> str:
    """``actor_rollout_ref.ref`` -> ``ref``: the role a worker task names (profiled_task)."""
    return section.rsplit(".", 1)[-1]


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
    tool: str = "torch"
    relocate: bool = False  # traces straight into save_path, the step in the file name
    # torch_memory: allocator-history settings and the window of profiled steps per snapshot
    memory: dict = dataclasses.field(default_factory=dict)
    # npu: tool_config.npu of the first enabled role (contents, level, analysis)
    npu: dict = dataclasses.field(default_factory=dict)
    # roles (actor, ref, rollout, critic) whose tool_config.<tool>.discrete is true: one trace per task
    discrete_roles: list = dataclasses.field(default_factory=list)
    # every enabled role is discrete: no step-wide trace (verl/utils/profiler/step_recorder.py)
    discrete: bool = False

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
            present = [s for s in sections if OmegaConf.select(cfg, f"{s}.profiler", default=None) is not None]
            enabled = [s for s in present if _select(cfg, f"{s}.profiler.enable", False)]
            if tool == "torch_memory" and not enabled:
                enabled = present[:1]  # upstream's memory snapshots do not wait for `enable`
            if not enabled:
                continue
            ranks: set[int] = set()
            contents: list[str] = []
            for s in enabled:
                if _select(cfg, f"{s}.profiler.enable", False):
                    ranks.update(int(r) for r in (_select(cfg, f"{s}.profiler.ranks") or []))
                for item in _select(cfg, f"{s}.profiler.tool_config.torch.contents") or []:
                    if item not in contents:
                        contents.append(item)
            all_ranks = any(_select(cfg, f"{s}.profiler.enable", False)
                            and _select(cfg, f"{s}.profiler.all_ranks", False) for s in enabled)
            if tool == "torch_memory" and not all_ranks and not ranks:
                ranks = {0}
            first = enabled[0]
            on = [s for s in enabled if _select(cfg, f"{s}.profiler.enable", False)]
            discrete = [s for s in on if tool in ("torch", "npu")
                        and _select(cfg, f"{s}.profiler.tool_config.{tool}.discrete", False)]
            workers[group] = WorkerProfileSpec(
                group=group,
                save_path=str(_select(cfg, f"{first}.profiler.save_path") or default_path),
                all_ranks=all_ranks,
                ranks=sorted(ranks),
                contents=contents,
                tool=tool or "torch",
                relocate=bool(_select(cfg, f"{first}.profiler.relocate_results", False)),
                memory=_memory_settings(cfg, first),
                npu=dict(_select(cfg, f"{first}.profiler.tool_config.npu") or {}),
                discrete_roles=[role_name(s) for s in discrete],
                discrete=bool(on) and len(discrete) == len(on),
            )
        return cls(tool=tool, steps=steps, continuous=continuous, workers=workers)

    @property
    def active(self) -> bool:
        return self.tool in BUILT_TOOLS and bool(self.steps) and bool(self.workers)


def _memory_settings(cfg, section: str) -> dict[str, Any]:
    role = f"{section}.profiler.tool_config.torch_memory"
    glob = "global_profiler.global_tool_config.torch_memory"
    return {"max_entries": int(_select(cfg, f"{role}.trace_alloc_max_entries", 100000)),
            "num_steps": int(_select(cfg, f"{role}.memory_snapshot_num_steps", 1)),
            "context": _select(cfg, f"{glob}.context", "all"),
            "stacks": _select(cfg, f"{glob}.stacks", "all"),
            "kw_args": dict(_select(cfg, f"{glob}.kw_args") or {})}


def _has_torch_npu() -> bool:
    import importlib.util

    return "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None


def _tool_problem(key: str, tool: Any) -> Optional[str]:
    if tool == "npu":
        if not _has_torch_npu():
            return (f"`{key}` is 'npu' (the Ascend profiler, torch_npu.profiler), but torch_npu is not installed "
                    f"here; run on an Ascend host with torch_npu, or use {key}=torch.")
        return None
    if tool is None or tool in BUILT_TOOLS:
        return None
    if tool in _OTHER_TOOLS:
        return (f"`{key}` is {tool!r} ({_OTHER_TOOLS[tool]}), which this project does not build; "
                f"use {key}=torch (torch.profiler traces), torch_memory or null.")
    return (f"`{key}` is {tool!r}; the profilers built here are torch and torch_memory, and npu on Ascend "
            f"(upstream also has {', '.join(_OTHER_TOOLS)}).")


def _npu_problems(cfg, section: str) -> list[str]:
    """The Ascend profiler's options, checked whether or not torch_npu is here (a typo is a typo anywhere)."""
    npu = f"{section}.profiler.tool_config.npu"
    if OmegaConf.select(cfg, npu, default=None) is None:
        return []
    problems = []
    bad = [c for c in (_select(cfg, f"{npu}.contents") or []) if c not in NPU_CONTENTS]
    if bad:
        problems.append(f"`{npu}.contents` has {bad}; allowed: {', '.join(NPU_CONTENTS)}.")
    level = _select(cfg, f"{npu}.level")
    if level not in NPU_LEVELS:
        problems.append(f"`{npu}.level` is {level!r}; allowed: {', '.join(NPU_LEVELS)}.")
    if not isinstance(_select(cfg, f"{npu}.analysis"), bool):
        problems.append(f"`{npu}.analysis` must be true or false.")
    return problems


def _memory_problems(cfg, section: str) -> list[str]:
    role = f"{section}.profiler.tool_config.torch_memory"
    problems = []
    for key in ("trace_alloc_max_entries", "memory_snapshot_num_steps", "stack_depth"):
        value = _select(cfg, f"{role}.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"`{role}.{key}` is {value!r}; it must be a positive integer.")
    return problems


def check_profiler_config(cfg) -> list[str]:
    """One message per problem in the profiler keys (validation collects them)."""
    problems: list[str] = []
    tool = _select(cfg, "global_profiler.tool")
    msg = _tool_problem("global_profiler.tool", tool)
    if msg:
        problems.append(msg)
    glob = "global_profiler.global_tool_config.torch_memory"
    for key, allowed in (("context", MEMORY_CONTEXTS), ("stacks", MEMORY_STACKS)):
        value = _select(cfg, f"{glob}.{key}", "all")
        if value not in allowed:
            problems.append(f"`{glob}.{key}` is {value!r}; allowed: {', '.join(allowed)}.")
    steps = _select(cfg, "global_profiler.steps")
    if steps is not None and (not isinstance(steps, list)
                              or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps)):
        problems.append(f"`global_profiler.steps` is {steps!r}; give a list of global steps (from 1), e.g. [2,5].")
    any_enabled = False
    for sections in GROUP_ROLES.values():
        for s in sections:
            if OmegaConf.select(cfg, f"{s}.profiler", default=None) is None:
                continue
            problems.extend(_npu_problems(cfg, s) + _memory_problems(cfg, s))
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
            for t in ("torch", "npu"):
                if not isinstance(_select(cfg, f"{s}.profiler.tool_config.{t}.discrete", False), bool):
                    problems.append(f"`{s}.profiler.tool_config.{t}.discrete` must be true (one trace per task) "
                                    "or false (one trace per step).")
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
    if any_enabled and tool in ("torch", "npu") and not steps:
        problems.append("`global_profiler.steps` is empty, so nothing would be profiled; list the steps, e.g. [1].")
    return problems
