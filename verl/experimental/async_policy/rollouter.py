"""The rollouter: a controller thread that keeps the rollout pool generating into a bounded queue.

It draws prompt chunks from the prompt loader, submits them to the rollout pool (:class:`~.pool.RolloutPool`),
collects them in order, scores them and queues each with the weight version that produced it. Up to ``depth``
chunks are in flight at once: the pool's engine batches them together, so a chunk's sequences take the decode
slots that an earlier chunk's short responses freed while its long tail still decodes. The thread always
prefers, in this order: submitting (while the schedule and the depth allow), scoring what it collected,
collecting the oldest chunk in flight (blocking); Ray runs one call of a worker at a time, so chunk k+1 is
submitted before chunk k is collected.

New weights from the trainer (:meth:`Rollouter.offer_weights`) stop the submissions; the chunks in flight finish
with the weights they started with, and once the pool holds none the new weights are installed and submission
goes on (the *drain*): a chunk is never generated with two versions. With ``partial`` (upstream's
``async_training.partial_rollout``) there is no drain: the thread installs the weights as soon as they are
offered, the pool pausing its decode session between two decode steps, and the unfinished responses go on with
the new weights (each token records the version it was sampled with). So that the thread is never stuck in a
collect while weights wait, it then polls the oldest chunk (``pool.ready``, ``poll_s``) instead of blocking.

How far it may run ahead is the :class:`~.schedule.Schedule`'s business: a submitted chunk counts against its
version's allowance and takes a place in the queue from its submission. A chunk keeps the version it was
submitted with (``RolloutChunk.version``), its oldest, also when partial rollout continues it with newer
weights: that is the version the staleness bound counts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from verl.protocol import DataProto

from .schedule import Schedule


@dataclass
class RolloutChunk:
    batch: DataProto  # generated and scored
    version: int  # the weight version it was submitted with (its oldest tokens')
    loader_state: dict  # the prompt loader's state right after this chunk was drawn
    rng_state: list  # the rollout ranks' sampling RNG states right after this chunk started
    gen_seconds: float  # submission to collection
    metrics: dict = field(default_factory=dict)


@dataclass
class _Job:
    handle: Any  # the pool's handle of the submitted chunk (set once submitted)
    version: int
    loader_state: Optional[dict]
    out: Any = None  # the pool's output once collected
    collected: bool = False


class Rollouter:
    """``pool`` is the rollout pool (``submit(batch_dict, ahead) -> handle`` at once, ``ahead`` being how many
    chunks at most will be in flight together with this one when it is the first in flight; ``collect(handle) -> out``, blocking,
    which sets ``handle.rng_state``; ``finish(handle, out) -> (batch, metrics)``, scoring on the controller;
    ``load_rollout_weights(weights, version, in_flight)``; with ``partial``, ``ready(handle, timeout) -> bool``;
    the handle's ``started`` time); ``prompts`` yields prompt chunks and ``loader_state()`` is the prompt loader's
    resumable state; ``depth``: chunks kept in flight; ``partial``: install weights with chunks in flight."""

    def __init__(self, schedule: Schedule, pool, prompts: Iterator[dict], loader_state: Callable[[], dict],
                 version: int = 0, depth: int = 1, partial: bool = False, poll_s: float = 0.05):
        if depth < 1:
            raise ValueError(f"the rollouter's pipeline depth must be >= 1, got {depth}")
        self.schedule = schedule
        self.depth = int(depth)
        self.partial = bool(partial)
        self.poll_s = float(poll_s)
        self._pool = pool
        self._prompts = prompts
        self._loader_state = loader_state
        self.version = version  # the version the rollout pool holds
        self._queue: list[RolloutChunk] = []
        self._jobs: deque[_Job] = deque()  # submitted, not queued yet (oldest first)
        self._on_pool = 0  # jobs submitted and not collected yet
        self._produced = 0  # chunks submitted with the current version
        self._pending: Optional[tuple[list, int]] = None  # newest weights offered, not yet installed
        # Chunks the trainer had not consumed when those weights were offered (queued or in flight): they count
        # against the new version's allowance (counted at the offer, i.e. upstream's sync; counting at the
        # install instead would miss what the trainer takes while the weights load).
        self._leftover = 0
        self._cond = threading.Condition()
        self._hold = 0  # callers of exclusive() waiting for or holding the pool
        self._busy = False  # the pool has chunks in flight or is loading weights (exclusive() waits)
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._busy_s = 0.0  # since the last metrics read
        self._idle_s = 0.0
        self._busy_since: Optional[float] = None
        self._max_on_pool = 0  # most chunks in flight since the last metrics read
        self.total_generated_samples = 0
        self._offered: Optional[tuple[float, int]] = None  # (time, chunks in flight) at the pending offer
        self._syncs = {"syncs": 0, "paused_at_sync": 0, "drained_at_sync": 0, "sync_wait_s": 0.0}  # since last read

    # -------------------------------------------------------------- thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollouter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()  # the chunks in flight finish: their workers are busy until they do

    def _may_start(self) -> bool:
        s = self.schedule
        room = s.max_queued is None or len(self._queue) + len(self._jobs) < s.max_queued
        # Pending weights restart the count at the chunks left over at the offer (upstream's reset at a sync:
        # what the trainer has not consumed yet counts against the new version's allowance, which bounds both
        # the queue and the staleness).
        produced = self._leftover if self._pending is not None else self._produced
        fresh = s.max_per_version is None or produced < s.max_per_version
        return room and fresh

    def _can_submit(self) -> bool:
        """Under the lock: the schedule allows a chunk, the depth has room, nobody waits for the pool, and pending
        weights (if any) can go in first because nothing is in flight."""
        return (not self._stop and self._hold == 0 and self._on_pool < self.depth and self._may_start()
                and (self._pending is None or self._on_pool == 0 or self.partial))

    def _swap_now(self) -> bool:
        """Under the lock: partial rollout, weights offered and chunks in flight: install them now (no drain)."""
        return self.partial and self._pending is not None and self._on_pool > 0 and self._hold == 0

    def _set_busy(self, busy: bool) -> None:
        now = time.perf_counter()
        if busy and not self._busy:
            self._busy_since = now
        elif not busy and self._busy:
            self._busy_s += now - self._busy_since
            self._busy_since = None
            self._cond.notify_all()
        self._busy = busy

    def _run(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self._cond:
                    while not (self._can_submit() or self._jobs or self._stop):
                        self._cond.wait()
                    if self._stop and not self._jobs:
                        return
                    if not self._busy:
                        self._idle_s += time.perf_counter() - t0
                    swap = self._swap_now()
                    submit = not swap and self._can_submit()
                    collected = bool(self._jobs) and self._jobs[0].collected
                    oldest_on_pool = self._jobs[len(self._jobs) - self._on_pool] if self._on_pool else None
                    if submit:
                        # Reserve the chunk's place now: weights offered from here on count it as left over.
                        self._set_busy(True)
                        job = _Job(None, self.version, None)
                        install = self._pending is not None  # (nothing is in flight: _can_submit)
                        ahead = self._session_depth(install) if self._on_pool == 0 else None
                        self._jobs.append(job)
                        self._on_pool += 1
                        self._produced += 0 if install else 1
                        self._max_on_pool = max(self._max_on_pool, self._on_pool)
                if swap:
                    self._install_pending()
                elif submit:
                    self._submit(job, install, ahead)
                elif collected:  # chunks are collected in order, so the oldest is the next to queue
                    self._queue_oldest()
                else:
                    self._collect(oldest_on_pool)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._cond:
                self._error = exc
                self._set_busy(False)
                self._cond.notify_all()

    def _session_depth(self, install: bool) -> int:
        """Under the lock, before the first chunk of a run of chunks in flight: how many can join it at most (the
        depth, or fewer where the version's allowance has less left; the pool sizes its slots by it). The pool
        is drained before any other version's chunk starts, so no more can ever be in flight together (with
        partial rollout it is not: chunks of several versions share the session, up to the depth)."""
        limit = self.schedule.max_per_version
        if limit is None or self.partial:
            return self.depth
        produced = self._leftover if install else self._produced
        return max(1, min(self.depth, limit - produced))

    def _submit(self, job: _Job, install: bool, ahead: Optional[int]) -> None:
        if install:
            self._install_pending(reserved=1)  # (this chunk's place is reserved, it is not in flight yet)
            with self._cond:
                self._produced += 1  # the install restarted the count at the leftover
                job.version = self.version
        batch_dict = next(self._prompts)
        job.loader_state = self._loader_state()
        job.handle = self._pool.submit(batch_dict, ahead or self.depth)

    def _collect(self, job: _Job) -> None:
        if self.partial and not self._pool.ready(job.handle, self.poll_s):
            return  # back to the loop: offered weights go in while the chunk decodes on
        out = self._pool.collect(job.handle)  # blocks until the chunk is done
        with self._cond:
            job.out, job.collected = out, True
            self._on_pool -= 1
            if self._on_pool == 0:
                self._set_busy(False)

    def _queue_oldest(self) -> None:
        with self._cond:
            job = self._jobs[0]
        batch, metrics = self._pool.finish(job.handle, job.out)
        seconds = time.perf_counter() - job.handle.started
        chunk = RolloutChunk(batch, job.version, job.loader_state, job.handle.rng_state, seconds, metrics)
        with self._cond:
            self._jobs.popleft()
            self._queue.append(chunk)
            self.total_generated_samples += len(batch)
            self._cond.notify_all()

    # -------------------------------------------------------------- weights
    def offer_weights(self, weights: list, version: int) -> None:
        """Newer weights for the pool: installed once the chunks in flight are collected, before the next chunk
        starts (an older offer not yet installed is superseded)."""
        with self._cond:
            if self._pending is None:
                self._leftover = len(self._queue) + len(self._jobs)
                self._offered = (time.perf_counter(), self._on_pool)
            self._pending = (weights, version)
            self._cond.notify_all()

    def _install_pending(self, reserved: int = 0) -> None:
        with self._cond:
            pending, self._pending = self._pending, None
            leftover, offered = self._leftover, self._offered
            in_flight = self._on_pool - reserved > 0
        if pending is not None:
            weights, version = pending
            self._pool.load_rollout_weights(weights, version, in_flight)
            with self._cond:
                self.version = version
                self._produced = leftover
                # What the sync cost the pool: paused (partial rollout: chunks were in flight and went on) or
                # drained (chunks were in flight at the offer and finished first), and offer -> install seconds.
                s = self._syncs
                s["syncs"] += 1
                s["paused_at_sync"] += int(in_flight)
                s["drained_at_sync"] += int(not in_flight and offered is not None and offered[1] > 0)
                s["sync_wait_s"] += time.perf_counter() - offered[0] if offered is not None else 0.0
                if self._pending is None:  # (an offer made during the load is the next install's)
                    self._offered = None

    @contextmanager
    def exclusive(self):
        """The pool to oneself once the chunks in flight are collected, with the newest offered weights
        installed (validation)."""
        with self._cond:
            self._hold += 1
            self._cond.notify_all()
            while self._busy and self._error is None:
                self._cond.wait()
            self._set_busy(True)
        try:
            self._install_pending()
            yield
        finally:
            with self._cond:
                self._hold -= 1
                self._set_busy(False)
                self._cond.notify_all()

    # -------------------------------------------------------------- the trainer's side
    def take(self, n: int) -> tuple[list[RolloutChunk], float]:
        """The ``n`` oldest chunks (blocking), and the seconds waited for them."""
        t0 = time.perf_counter()
        with self._cond:
            while len(self._queue) < n and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"the rollouter failed: {self._error}") from self._error
            chunks, self._queue = self._queue[:n], self._queue[n:]
            self._cond.notify_all()
        return chunks, time.perf_counter() - t0

    def queue_size(self) -> int:
        with self._cond:
            return len(self._queue)

    def read_utilization(self) -> dict[str, float]:
        """Busy and idle seconds since the last read (upstream's rollouter metrics), the pipeline depth, the
        most chunks that were in flight at once, and the weight installs since the last read: how many, how many
        paused chunks in flight (partial rollout) or waited for them to drain, and the seconds from offer to
        install (summed)."""
        with self._cond:
            now = time.perf_counter()
            if self._busy_since is not None:  # the pool is busy right now: count up to here
                self._busy_s += now - self._busy_since
                self._busy_since = now
            busy, idle, most = self._busy_s, self._idle_s, self._max_on_pool
            self._busy_s = self._idle_s = 0.0
            self._max_on_pool = self._on_pool
            syncs = self._syncs
            self._syncs = dict.fromkeys(syncs, 0)
            self._syncs["sync_wait_s"] = 0.0
        total = busy + idle
        out = {"fully_async/rollouter/active_time": busy,
               "fully_async/rollouter/idle_ratio": idle / total if total > 0 else 0.0,
               "fully_async/rollouter/pipeline_depth": self.depth,
               "fully_async/rollouter/max_chunks_in_flight": most,
               "fully_async/rollouter/partial_rollout": float(self.partial)}
        out.update({f"fully_async/rollouter/{k}": float(v) for k, v in syncs.items()})
        return out
