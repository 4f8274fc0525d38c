"""Intra-op threads of CPU workers (verl.utils.device.cpu_threads_per_worker): VERL_CPU_THREADS wins; otherwise the
host's cores split over the node's workers, and 1 on a host already busy (load average at or above its cores)."""

import os

from verl.utils.device import cpu_threads_per_worker


def test_env_override_wins(monkeypatch):
    monkeypatch.setenv("VERL_CPU_THREADS", "3")
    assert cpu_threads_per_worker(8) == 3
    monkeypatch.setenv("VERL_CPU_THREADS", "0")
    assert cpu_threads_per_worker(1) == 1


def test_cores_split_over_workers_unless_busy(monkeypatch):
    monkeypatch.delenv("VERL_CPU_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert [cpu_threads_per_worker(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 2.0, 1.0))  # busy now: no extra spinning threads
    assert cpu_threads_per_worker(1) == 1
