"""tool=npu inside a worker: the Ascend profiler (torch_npu.profiler) around each profiled step, or around each
task of a discrete role (``tool_config.npu.discrete``; :mod:`.step_recorder`).

Validation has already refused tool=npu where torch_npu is missing and checked the options; here they are
mapped onto torch_npu's profiler: ``contents`` picks the activities and what is recorded (empty: everything),
``level`` the collection level, ``analysis`` whether torch_npu parses the data when a trace is written
(under ``<save_path>/<step>/<group>_rank<rank>[_<stage>]/``, or ``<save_path>/<step>_<group>_rank<rank>[_<stage>]/``
with relocate_results).
"""

from __future__ import annotations

import os
from typing import Any

from .step_recorder import StepTaskRecorder

__all__ = ["NPUTraceRecorder"]

_LEVELS = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}


class NPUTraceRecorder(StepTaskRecorder):
    def _open(self, spec: dict, target: str) -> Any:
        import torch_npu

        npu = spec.get("npu") or {}
        contents = set(npu.get("contents") or ())
        wants = (lambda item: not contents or item in contents)  # empty contents: record everything
        prof_mod = torch_npu.profiler
        activities = [prof_mod.ProfilerActivity.CPU] if wants("cpu") else []
        if wants("npu"):
            activities.append(prof_mod.ProfilerActivity.NPU)
        os.makedirs(target, exist_ok=True)
        return prof_mod.profile(
            activities=activities, with_stack=wants("stack"), record_shapes=wants("shapes"),
            profile_memory=wants("memory"), with_modules=wants("module"),
            experimental_config=prof_mod._ExperimentalConfig(
                profiler_level=getattr(prof_mod.ProfilerLevel, _LEVELS[npu.get("level", "level0")])),
            on_trace_ready=prof_mod.tensorboard_trace_handler(target, analyse_flag=bool(npu.get("analysis", True))))

    def _close(self, prof: Any, target: str) -> None:
        prof.stop()  # on_trace_ready writes (and, with analysis, parses) the data into target
