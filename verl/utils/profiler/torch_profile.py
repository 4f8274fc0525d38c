"""torch.profiler inside a worker: a Chrome trace per profiled step, or per task of a discrete role
(:mod:`.step_recorder`)."""

from __future__ import annotations

import os

import torch

from .step_recorder import StepTaskRecorder, trace_path

__all__ = ["TorchTraceRecorder", "trace_path"]


class TorchTraceRecorder(StepTaskRecorder):
    """One recorder per worker process; traces land where :func:`trace_path` says."""

    suffix = ".json"

    def _open(self, spec: dict, target: str) -> torch.profiler.profile:
        contents = set(spec.get("contents") or ())
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and (not contents or "cuda" in contents):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if contents and "cpu" not in contents and len(activities) > 1:
            activities = activities[1:]  # cuda only
        return torch.profiler.profile(activities=activities, record_shapes="shapes" in contents,
                                      profile_memory="memory" in contents, with_stack="stack" in contents)

    def _close(self, prof: torch.profiler.profile, target: str) -> None:
        prof.stop()
        os.makedirs(os.path.dirname(target), exist_ok=True)
        prof.export_chrome_trace(target)
