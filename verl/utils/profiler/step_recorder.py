"""What the torch and npu recorders share: a trace per profiled step, or (``tool_config.<tool>.discrete``) one
trace per task a discrete role runs in that step.

Upstream's ``discrete=True`` opens a profiler around each of a role's worker calls ("tasks": the actor's
log-prob pass and update, the reference's log-prob pass, the rollout's generation, the critic's calls) instead of
one for the whole step. A process runs one profiler at a time (torch.profiler and torch_npu's are process-wide),
so within one worker group:

* every enabled role discrete: nothing runs between tasks; each task of a discrete role writes its own trace,
  ``<group>_rank<r>_<stage>`` next to where the step trace would go (``<save_path>/<step>/``);
* some enabled role not discrete: the step trace runs as before, and each task shows in it as a labelled range
  (``record_function(<stage>)``), as upstream labels tasks inside its end-to-end trace.

The worker side is :func:`verl.single_controller.profiler_worker.profiled_task`, which wraps each task method
in :meth:`StepTaskRecorder.task`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

import torch

__all__ = ["StepTaskRecorder", "trace_path"]


def trace_path(spec: dict, label: str, rank: int, suffix: str) -> str:
    """``<save_path>/<label>/<group>_rank<rank><suffix>``, or with ``relocate`` (relocate_results)
    ``<save_path>/<label>_<group>_rank<rank><suffix>``: every trace in save_path itself."""
    save_path = os.path.expanduser(spec["save_path"])
    name = f"{spec['group']}_rank{rank}{suffix}"
    if spec.get("relocate"):
        return os.path.join(save_path, f"{label}_{name}")
    return os.path.join(save_path, label, name)


class StepTaskRecorder:
    """Subclasses say how a profiler is opened on a target (``_open``) and closed / written (``_close``)."""

    suffix = ""  # the file name's ending (a Chrome trace ".json"; torch_npu writes a directory)

    def __init__(self) -> None:
        self._armed: Optional[tuple[dict, int, str]] = None  # (spec, rank, step label) while a step is profiled
        self._prof: Any = None  # the step-wide profiler, when one runs
        self._target: Optional[str] = None
        self._written: list[str] = []

    def _open(self, spec: dict, target: str) -> Any:
        raise NotImplementedError

    def _close(self, prof: Any, target: str) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._armed is not None

    def start(self, spec: dict, rank: int, label: str) -> bool:
        """Arm for one profiled step if this rank is chosen (and open the step trace unless all roles are
        discrete); returns whether this rank takes part."""
        if self._armed is not None or not (spec["all_ranks"] or rank in spec["ranks"]):
            return False
        self._armed, self._written = (spec, rank, label), []
        if not spec.get("discrete"):
            self._target = trace_path(spec, label, rank, self.suffix)
            self._prof = self._open(spec, self._target)
            self._prof.start()
        return True

    @contextlib.contextmanager
    def task(self, role: str, stage: str) -> Iterator[None]:
        """Around one task of ``role``: its own trace (a discrete role, no step trace) or a label in the step
        trace; nothing when this step is not profiled here."""
        if self._armed is None:
            yield
            return
        spec, rank, label = self._armed
        if self._prof is not None:
            with torch.profiler.record_function(stage):
                yield
            return
        if role not in (spec.get("discrete_roles") or ()):
            yield
            return
        target = trace_path(spec, label, rank, f"_{stage}{self.suffix}")
        prof = self._open(spec, target)
        prof.start()
        try:
            with torch.profiler.record_function(stage):
                yield
        finally:  # a failing task must not leave the process-wide profiler running
            self._close(prof, target)
            self._written.append(target)

    def stop(self) -> list[str]:
        """End the profiled step; returns the traces written in it (step trace first)."""
        if self._armed is None:
            return []
        written = list(self._written)
        if self._prof is not None:
            self._close(self._prof, self._target)
            written.insert(0, self._target)
        self._armed, self._prof, self._target, self._written = None, None, None, []
        return written
