"""The two worker methods the trainer's profiler hook calls; every :class:`Worker` has them (a worker concern:
the recorder itself is :mod:`verl.utils.profiler.torch_profile`)."""

from __future__ import annotations

import functools
from typing import Callable

from verl.single_controller.decorator import Dispatch, register

__all__ = ["ProfilerWorkerMixin", "profiled_task"]


def profiled_task(role: str, stage: str) -> Callable:
    """Mark a worker method as one task of ``role`` (``stage`` names it in traces): in a profiled step a discrete
    role gets a trace of its own for the call, otherwise the call is a labelled range in the step trace. Put it
    below ``@register`` (register wraps what this returns)."""

    def decorate(fn):
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            task = getattr(self._trace_recorder, "task", None)  # torch_memory snapshots have no tasks
            if task is None:
                return fn(self, *args, **kwargs)
            with task(role, stage):
                return fn(self, *args, **kwargs)

        return run

    return decorate


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
    def stop_profile(self) -> list[str]:
        """The traces this rank wrote in the profiled step(s) just ended."""
        written = self._trace_recorder.stop() if self._trace_recorder is not None else None
        if written is None:
            return []
        return [written] if isinstance(written, str) else list(written)
