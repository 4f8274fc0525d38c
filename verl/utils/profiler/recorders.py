"""global_profiler.tool -> the recorder a worker process runs for it (imported lazily by the workers)."""

from __future__ import annotations

__all__ = ["recorder_for"]


def recorder_for(tool: str):
    if tool == "torch":
        from .torch_profile import TorchTraceRecorder

        return TorchTraceRecorder()
    if tool == "torch_memory":
        from .torch_memory import MemorySnapshotRecorder

        return MemorySnapshotRecorder()
    if tool == "npu":
        from .npu_profile import NPUTraceRecorder

        return NPUTraceRecorder()
    raise ValueError(f"global_profiler.tool={tool!r} has no recorder here")  # validation refuses it first
