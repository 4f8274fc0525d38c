"""The rollouter: a controller thread that keeps the rollout pool generating into a bounded queue.

It draws prompt chunks from the prompt loader, generates and scores them on the rollout pool (through the
trainer's ``generate_and_score``), and queues each chunk with the weight version that produced it. New
weights from the trainer are installed between chunks (:meth:`Rollouter.offer_weights`): a chunk is never
generated with two versions, so the per-token version of a chunk is the chunk's version. How far it may run
ahead is the :class:`~.schedule.Schedule`'s business.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from verl.protocol import DataProto

from .schedule import Schedule


@dataclass
class RolloutChunk:
    batch: DataProto  # generated and scored
    version: int  # the weight version that generated it
    loader_state: dict  # the prompt loader's state right after this chunk was drawn
    rng_state: list  # the rollout ranks' sampling RNG states right after generating it
    gen_seconds: float
    metrics: dict = field(default_factory=dict)


class Rollouter:
    """``generate(batch_dict) -> (DataProto, metrics)`` runs one chunk on the rollout pool; ``rollout_wg`` is
    that pool's worker group (``load_rollout_weights``, ``rollout_rng_state``); ``prompts`` yields prompt
    chunks and ``loader_state()`` is the prompt loader's resumable state."""

    def __init__(self, schedule: Schedule, generate: Callable, rollout_wg, prompts: Iterator[dict],
                 loader_state: Callable[[], dict], version: int = 0):
        self.schedule = schedule
        self._generate = generate
        self._wg = rollout_wg
        self._prompts = prompts
        self._loader_state = loader_state
        self.version = version  # the version the rollout pool holds
        self._queue: list[RolloutChunk] = []
        self._produced = 0  # chunks generated with the current version
        self._pending: Optional[tuple[list, int]] = None  # newest weights offered, not yet installed
        # Chunks the trainer had not consumed when those weights were offered, plus old-version chunks finished
        # since: they count against the new version's allowance (counted at the offer, i.e. upstream's sync;
        # counting at the install instead would miss what the trainer takes while the weights load).
        self._leftover = 0
        self._cond = threading.Condition()
        self._gen_lock = threading.Lock()  # held while the pool generates (validation waits on it)
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._busy_s = 0.0  # since the last metrics read
        self._idle_s = 0.0
        self.total_generated_samples = 0

    # -------------------------------------------------------------- thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollouter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()  # the chunk in flight finishes: its workers are busy until it does

    def _may_start(self) -> bool:
        s = self.schedule
        room = s.max_queued is None or len(self._queue) < s.max_queued
        # Pending weights restart the count at the chunks left over at the offer (upstream's reset at a sync:
        # what the trainer has not consumed yet counts against the new version's allowance, which bounds both
        # the queue and the staleness).
        produced = self._leftover if self._pending is not None else self._produced
        fresh = s.max_per_version is None or produced < s.max_per_version
        return room and fresh

    def _run(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self._cond:
                    while not self._stop and not self._may_start():
                        self._cond.wait()
                    if self._stop:
                        return
                    self._idle_s += time.perf_counter() - t0
                with self._gen_lock:
                    t1 = time.perf_counter()
                    self._install_pending()
                    batch_dict = next(self._prompts)
                    loader_state = self._loader_state()
                    batch, metrics = self._generate(batch_dict)
                    rng = self._wg.rollout_rng_state()
                    seconds = time.perf_counter() - t1
                chunk = RolloutChunk(batch, self.version, loader_state, rng, seconds, metrics)
                with self._cond:
                    self._queue.append(chunk)
                    self._produced += 1
                    if self._pending is not None:  # finished after newer weights were offered: stale already
                        self._leftover += 1
                    self._busy_s += seconds
                    self.total_generated_samples += len(batch)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    # -------------------------------------------------------------- weights
    def offer_weights(self, weights: list, version: int) -> None:
        """Newer weights for the pool: installed before the next chunk starts (an older offer not yet
        installed is superseded)."""
        with self._cond:
            if self._pending is None:
                self._leftover = len(self._queue)
            self._pending = (weights, version)
            self._cond.notify_all()

    def _install_pending(self) -> None:
        with self._cond:
            pending, self._pending = self._pending, None
            leftover = self._leftover
        if pending is not None:
            weights, version = pending
            self._wg.load_rollout_weights(weights, version)
            with self._cond:
                self.version = version
                self._produced = leftover

    @contextmanager
    def exclusive(self):
        """The pool to oneself between chunks, with the newest offered weights installed (validation)."""
        with self._gen_lock:
            self._install_pending()
            yield

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
        """Busy and idle seconds since the last read (upstream's rollouter metrics)."""
        with self._cond:
            busy, idle = self._busy_s, self._idle_s
            self._busy_s = self._idle_s = 0.0
        total = busy + idle
        return {"fully_async/rollouter/active_time": busy,
                "fully_async/rollouter/idle_ratio": idle / total if total > 0 else 0.0}
