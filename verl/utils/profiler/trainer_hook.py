"""The trainer side: around each profiled step, tell the chosen worker groups to start and stop tracing."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from .config import ProfilePlan

__all__ = ["StepProfiler"]

logger = logging.getLogger(__name__)


class StepProfiler:
    """``with profiler.step(global_step): ...`` traces that step on the workers the config selects."""

    def __init__(self, config, worker_groups: dict):
        self.plan = ProfilePlan.from_config(config)
        self.groups = {name: wg for name, wg in worker_groups.items() if name in self.plan.workers}
        self._running_since: int | None = None
        self.traces: list[str] = []  # written trace files, for the log and for tests

    @contextmanager
    def step(self, global_step: int) -> Iterator[None]:
        profiled = self.plan.active and global_step in self.plan.steps
        if profiled and self._running_since is None:
            self._running_since = global_step
            label = f"step{global_step}"
            for name, wg in self.groups.items():
                wg.start_profile(self.plan.workers[name].as_dict(), label)
        try:
            yield
        finally:
            keep_going = profiled and self.plan.continuous and (global_step + 1) in self.plan.steps
            if self._running_since is not None and not keep_going:
                self._running_since = None
                for wg in self.groups.values():
                    for per_rank in wg.stop_profile() or []:  # each rank's list of written traces
                        self.traces.extend(p for p in ([per_rank] if isinstance(per_rank, str) else per_rank or [])
                                           if p)
                logger.info("profiler traces: %s", self.traces)
