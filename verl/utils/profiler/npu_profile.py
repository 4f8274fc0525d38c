"""tool=npu inside a worker: the Ascend profiler (torch_npu.profiler) around each profiled step.

Validation has already refused tool=npu where torch_npu is missing and checked the options; here they are
mapped onto torch_npu's profiler: ``contents`` picks the activities and what is recorded (empty: everything),
``level`` the collection level, ``analysis`` whether torch_npu parses the data when the step's trace is written
(under ``<save_path>/<step>/<group>_rank<rank>/``, or ``<save_path>/<step>_<group>_rank<rank>/`` with
relocate_results).
"""

from __future__ import annotations

import os
from typing import Optional

from .torch_profile import trace_path

__all__ = ["NPUTraceRecorder"]

_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}


class NPUTraceRecorder:
    def __init__(self) -> None:
        self._prof = None
        self._target: Optional[str] = None

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self, spec: dict, rank: int, label: str) -> bool:
        if self._prof is not None or not (spec["all_ranks"] or rank in spec["ranks"]):
            return False
        import torch_npu

        npu = spec.get("npu") or {}
        contents = set(npu.get("contents") or ())
        wants = (lambda item: not contents or item in contents)  # empty contents: record everything
        prof_mod = torch_npu.profiler
        activities = [prof_mod.ProfilerActivity.CPU] if wants("cpu") else []
        if wants("npu"):
            activities.append(prof_mod.ProfilerActivity.NPU)
        self._target = trace_path(spec, label, rank, "")
        os.makedirs(self._target, exist_ok=True)
        self._prof = prof_mod.profile(
            activities=activities, with_stack=wants("stack"), record_shapes=wants("shapes"),
            profile_memory=wants("memory"), with_modules=wants("module"),
            experimental_config=prof_mod._ExperimentalConfig(
                profiler_level=getattr(prof_mod.ProfilerLevel, _LEVELS[npu.get("level", "level0")])),
            on_trace_ready=prof_mod.tensorboard_trace_handler(self._target,
                                                              analyse_flag=bool(npu.get("analysis", True))))
        self._prof.start()
        return True

    def stop(self) -> Optional[str]:
        if self._prof is None:
            return None
        prof, target = self._prof, self._target
        self._prof = self._target = None
        prof.stop()  # on_trace_ready writes (and, with analysis, parses) the data into target
        return target
