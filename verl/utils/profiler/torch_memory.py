"""tool=torch_memory inside a worker: record memory over a window of profiled steps, then write a snapshot.

On CUDA the allocator's history is recorded (``torch.cuda.memory._record_memory_history`` with
``trace_alloc_max_entries`` / ``context`` / ``stacks`` / ``kw_args``) and dumped as a ``.pickle`` snapshot, the
file pytorch.org/memory_viz reads (upstream's format). Without CUDA there is no allocator history, so the same
window is recorded with torch.profiler's memory profiling and written as its memory timeline (``.json``: times
and bytes per category), so a CPU run still gets a real memory trace.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from .torch_profile import trace_path

__all__ = ["MemorySnapshotRecorder"]


class MemorySnapshotRecorder:
    """One per worker process. ``start``/``stop`` bracket each profiled step; a snapshot is written when
    ``memory_snapshot_num_steps`` profiled steps have been recorded (the window's steps name its file)."""

    def __init__(self) -> None:
        self._spec: Optional[dict] = None
        self._rank = 0
        self._first: Optional[str] = None  # label of the window's first step
        self._last: Optional[str] = None
        self._steps = 0
        self._prof: Optional[torch.profiler.profile] = None  # the CPU stand-in for the allocator history
        self._in_step = False

    @property
    def running(self) -> bool:
        return self._in_step

    def start(self, spec: dict, rank: int, label: str) -> bool:
        if self._in_step or not (spec["all_ranks"] or rank in spec["ranks"]):
            return False
        self._spec, self._rank, self._in_step = spec, rank, True
        self._first = self._first or label
        self._last = label
        if self._steps == 0:
            self._begin(spec["memory"])
        return True

    def stop(self) -> Optional[str]:
        if not self._in_step:
            return None
        self._in_step = False
        self._steps += 1
        if self._steps < int(self._spec["memory"].get("num_steps", 1)):
            return None  # the window goes on: the next profiled step adds to the same snapshot
        label = self._first if self._first == self._last else f"{self._first}-{self._last}"
        target = self._dump(label)
        self._first = self._last = None
        self._steps = 0
        return target

    # -- the two backends ------------------------------------------------------------------
    def _begin(self, memory: dict) -> None:
        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(
                max_entries=int(memory.get("max_entries", 100000)), context=memory.get("context", "all"),
                stacks=memory.get("stacks", "all"), **dict(memory.get("kw_args") or {}))
            return
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                            record_shapes=True, with_stack=True)
        self._prof.start()

    def _dump(self, label: str) -> str:
        cuda = self._prof is None
        target = trace_path(self._spec, label, self._rank, "_torch_memory" + (".pickle" if cuda else ".json"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if cuda:
            torch.cuda.memory._dump_snapshot(target)
            torch.cuda.memory._record_memory_history(enabled=None)  # the next window starts empty
            return target
        prof, self._prof = self._prof, None
        prof.stop()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch points CPU users at the CUDA-only API
            prof.export_memory_timeline(target, device="cpu")
        return target
