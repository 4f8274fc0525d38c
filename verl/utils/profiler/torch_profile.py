"""torch.profiler inside a worker: start before a profiled step, stop and write a Chrome trace after it."""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["TorchTraceRecorder", "trace_path"]


def trace_path(spec: dict, label: str, rank: int, suffix: str) -> str:
    """``<save_path>/<label>/<group>_rank<rank><suffix>``, or with ``relocate`` (relocate_results)
    ``<save_path>/<label>_<group>_rank<rank><suffix>``: every trace in save_path itself."""
    save_path = os.path.expanduser(spec["save_path"])
    name = f"{spec['group']}_rank{rank}{suffix}"
    if spec.get("relocate"):
        return os.path.join(save_path, f"{label}_{name}")
    return os.path.join(save_path, label, name)


class TorchTraceRecorder:
    """One recorder per worker process; traces land where :func:`trace_path` says."""

    def __init__(self) -> None:
        self._prof: Optional[torch.profiler.profile] = None
        self._target: Optional[str] = None

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self, spec: dict, rank: int, label: str) -> bool:
        """Start tracing if this rank is chosen; returns whether it started."""
        if self._prof is not None or not (spec["all_ranks"] or rank in spec["ranks"]):
            return False
        contents = set(spec.get("contents") or ())
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and (not contents or "cuda" in contents):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if contents and "cpu" not in contents and len(activities) > 1:
            activities = activities[1:]  # cuda only
        self._prof = torch.profiler.profile(
            activities=activities,
            record_shapes="shapes" in contents,
            profile_memory="memory" in contents,
            with_stack="stack" in contents,
        )
        self._target = trace_path(spec, label, rank, ".json")
        self._prof.start()
        return True

    def stop(self) -> Optional[str]:
        """Stop and write the trace; returns its path (None when nothing was running)."""
        if self._prof is None:
            return None
        prof, target = self._prof, self._target
        self._prof = self._target = None
        prof.stop()
        os.makedirs(os.path.dirname(target), exist_ok=True)
        prof.export_chrome_trace(target)
        return target
