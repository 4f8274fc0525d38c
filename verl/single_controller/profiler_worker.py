"""The two worker methods the trainer's profiler hook calls; every :class:`Worker` has them (a worker concern:
the recorder itself is :mod:`verl.utils.profiler.torch_profile`)."""

from __future__ import annotations

from typing import Optional

from verl.single_controller.decorator import Dispatch, register

__all__ = ["ProfilerWorkerMixin"]


class ProfilerWorkerMixin:
    """``start_profile`` / ``stop_profile`` on every rank (each rank decides from the spec whether it traces)."""

    _trace_recorder = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, spec: dict, label: str) -> bool:
        from verl.utils.profiler.recorders import recorder_for

        if self._trace_recorder is None:
            self._trace_recorder = recorder_for(spec.get("tool", "torch"))
        return self._trace_recorder.start(spec, int(getattr(self, "rank", 0)), label)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> Optional[str]:
        return self._trace_recorder.stop() if self._trace_recorder is not None else None
