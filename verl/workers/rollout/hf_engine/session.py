"""A decode engine that stays open across generation chunks: continuous batching spans chunks.

:meth:`DecodeEngine.run` serves one call: its batch lasts as long as its longest sequence, and slots freed by
the short ones idle once its waiting queue is empty. An :class:`EngineSession` keeps one engine (slot cache,
captured graphs) and a background thread running the engine's host loop (:meth:`DecodeEngine.step`):

* :meth:`submit` appends a chunk's sequences to the waiting queue and returns at once;
* the thread admits waiting sequences into free slots whichever chunk they belong to, so a later chunk's
  sequences fill the slots that an earlier chunk's short responses freed while its long tail still decodes;
* :meth:`collect` blocks until every sequence of one chunk is done and returns its results (in submission
  order), with the engine's stats since the previous collect (decode steps, slot-steps, prefills: the share
  of decode slot-steps with no live sequence stays ``1 - slot_steps / (decode_steps x slots)``).

Results do not depend on what shares the batch: the sampler draws from a counter-based stream per sequence key
(:mod:`.sampling`), so a chunk generated in a session equals the same chunk generated alone, token for token.

Sequences must fit the cache allocated when the session opened (``max_len`` / ``max_new``); a chunk that does
not waits until the running ones finish and the cache is rebuilt for it (a new warm-up).

Weights change only while the session is paused (``async_training.partial_rollout``): :meth:`pause` parks the
thread between two rounds of decode steps (none half-done, the device idle), the caller copies the new weights
into the same parameter storage (so the captured CUDA graphs, which read those addresses, stay valid), and
:meth:`resume` with the new weight version re-prefills every live sequence's prefix with the new weights
(:meth:`DecodeEngine.reprefill`) before decoding on. Each result carries the weight version of every stretch of
its tokens (``SeqResult.versions``); a sequence admitted after the resume has only the new one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Hashable, Optional

import torch

from verl.workers.rollout.hf_engine.engine import DecodeEngine, SeqRequest, SeqResult

# Stats that count work over the session's lifetime; collect hands out their increase since the last collect
# (and the asynchronous trainer sums them over a step's chunks).
COUNTED_STATS = ("capture_s", "prefill_s", "prefills", "prefill_tokens", "decode_steps", "slot_steps", "warmup_s",
                 "device_wait_s", "pauses", "paused_s", "reprefills", "reprefill_tokens", "reprefill_s")


class EngineSession:
    def __init__(self, engine: DecodeEngine, capacity: int, max_len: int, max_new: int, version: int = 0):
        self.engine = engine
        self._shape = (capacity, max_len, max_new)
        self.capacity = engine.setup(capacity, max_len, max_new)
        self._max_len, self._max_new = max_len, max_new
        self._cond = threading.Condition()
        self._seqs: list[SeqRequest] = []
        self._results: list[Optional[SeqResult]] = []
        self._chunks: dict[Hashable, tuple[int, int]] = {}  # tag -> [start, end) in _seqs
        self._inbox: deque[int] = deque()
        self._left: dict[Hashable, int] = {}  # tag -> sequences not finished yet
        self._owner: list[Hashable] = []
        self._closing = False
        self._error: Optional[BaseException] = None
        self.version = int(version)  # the weights' version (set by resume)
        self._decoding = self.version  # the version the thread decodes with (it takes the new one after re-prefill)
        self._spans: dict[int, list[tuple[int, int]]] = {}  # admitted sequence -> [(first token, version)]
        self._pause = False  # pause() asked the thread to park
        self._parked = False  # the thread is parked between rounds
        self._resume_to: Optional[int] = None  # the version resume() hands the thread
        self._reported = {k: 0.0 for k in COUNTED_STATS}
        self._t_open = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="hf-engine-session", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side
    def submit(self, tag: Hashable, seqs: list[SeqRequest]) -> None:
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"the decode session failed: {self._error}") from self._error
            if tag in self._chunks:
                raise ValueError(f"chunk {tag!r} was already submitted to this session")
            start = len(self._seqs)
            self._seqs.extend(seqs)
            self._results.extend([None] * len(seqs))
            self._owner.extend([tag] * len(seqs))
            self._chunks[tag] = (start, len(self._seqs))
            self._left[tag] = len(seqs)
            self._inbox.extend(range(start, len(self._seqs)))
            self._cond.notify_all()

    def collect(self, tag: Hashable) -> tuple[list[SeqResult], dict]:
        """The chunk's results (blocking) and the engine's stats since the previous collect."""
        with self._cond:
            if tag not in self._chunks:
                raise KeyError(f"chunk {tag!r} was not submitted to this session")
            while self._left[tag] and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"the decode session failed: {self._error}") from self._error
            start, end = self._chunks.pop(tag)
            del self._left[tag]
            results = self._results[start:end]
            for i in range(start, end):  # the session holds finished results only until collected
                self._results[i] = None
            stats = self._stats_delta()
        stats.update(self.engine.spec_stats(results))
        return results, stats

    def ready(self, tag: Hashable, timeout: float = 0.0) -> bool:
        """Whether chunk ``tag`` is done, waiting up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if tag not in self._chunks:
                raise KeyError(f"chunk {tag!r} was not submitted to this session")
            while self._left[tag] and self._error is None and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if self._error is not None:
                raise RuntimeError(f"the decode session failed: {self._error}") from self._error
            return not self._left[tag]

    def pending(self) -> int:
        """Chunks submitted and not collected yet."""
        with self._cond:
            return len(self._chunks)

    def pause(self) -> None:
        """Park the thread between two rounds of decode steps and return once it is parked (the device idle):
        the caller may then change the weights in place. Submitting goes on; nothing decodes until :meth:`resume`."""
        with self._cond:
            self._pause = True
            self._cond.notify_all()
            while not self._parked and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"the decode session failed: {self._error}") from self._error

    def resume(self, version: int) -> None:
        """Go on decoding with the weights installed while paused, as weight version ``version``: a new version
        re-prefills the live sequences first (the same version means the weights did not change)."""
        device = self.engine.runner.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the caller's weight copies land before the thread reads them
        with self._cond:
            if not self._pause:
                raise RuntimeError("resume() without pause()")
            self._pause, self._parked, self._resume_to = False, False, int(version)
            self.version = int(version)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (after the sequences it holds finish) and free the cache."""
        with self._cond:
            self._closing = True
            self._pause = False
            self._cond.notify_all()
        self._thread.join()
        self.engine.teardown()

    # ------------------------------------------------------------------ internals
    def _stats_delta(self) -> dict:
        stats = dict(self.engine.opt.stats)
        for k in COUNTED_STATS:
            now = float(stats.get(k, 0.0))
            stats[k], self._reported[k] = now - self._reported[k], now
        stats["run_s"] = time.perf_counter() - self._t_open  # the session's age at this collect
        return stats

    def _fits(self, i: int) -> bool:
        s = self._seqs[i]
        return len(s.prompt.ids) + s.max_new <= self._max_len and s.max_new <= self._max_new

    def _rebuild(self, waiting: deque) -> None:
        """The head of the queue does not fit the cache and nothing runs: a cache for the waiting sequences."""
        max_new = max(self._max_new, max(self._seqs[i].max_new for i in waiting))
        max_len = max(self._max_len, max(len(self._seqs[i].prompt.ids) + max_new for i in waiting))
        counted = {k: float(self.engine.opt.stats.get(k, 0.0)) for k in COUNTED_STATS}
        self.engine.teardown()
        self.capacity = self.engine.setup(self._shape[0], max_len, max_new)
        for k, v in counted.items():  # setup clears the stats; the session's counts go on
            self.engine.opt.stats[k] = self.engine.opt.stats.get(k, 0.0) + v
        self._max_len, self._max_new = max_len, max_new

    def _run(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # the current device is per thread
        waiting: deque[int] = deque()
        running: list[int] = []
        budget: dict[int, int] = {}
        try:
            with torch.no_grad():  # grad mode is per thread too
                while True:
                    with self._cond:
                        while (not self._inbox and not waiting and not running and not self._closing
                               and not self._pause):
                            self._cond.wait()
                        resume_to = self._park() if self._pause else None
                        waiting.extend(self._inbox)
                        self._inbox.clear()
                        if self._closing and not waiting and not running:
                            return
                    if resume_to is not None and resume_to != self._decoding:
                        self._reprefill(running, resume_to)
                    # Only the sequences up to the first that does not fit the cache may be admitted; that one
                    # waits until nothing runs, then the cache is rebuilt for it.
                    ready: deque[int] = deque()
                    while waiting and self._fits(waiting[0]):
                        ready.append(waiting.popleft())
                    if waiting and not ready and not running:
                        self._rebuild(waiting)
                        continue
                    self._step(ready, running, budget)
                    ready.extend(waiting)
                    waiting = ready
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's collect
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _park(self) -> Optional[int]:
        """Under the lock, between rounds: wait out the pause; the version resume() gave (None: closing)."""
        device = self.engine.runner.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # no kernel of the last round still reads the weights
        t0 = time.perf_counter()
        while self._pause and not self._closing:  # (a pause right after a resume keeps it parked)
            self._parked = True
            self._cond.notify_all()
            self._cond.wait()
        self._parked = False
        stats = self.engine.opt.stats
        stats["pauses"] = stats.get("pauses", 0) + 1
        stats["paused_s"] = stats.get("paused_s", 0.0) + time.perf_counter() - t0
        resume_to, self._resume_to = self._resume_to, None
        return resume_to

    def _reprefill(self, running: list[int], version: int) -> None:
        """The weights changed: the live sequences' prefixes through the new ones; their later tokens are
        ``version``'s."""
        steps = self.engine.reprefill(self._seqs, running)
        self._decoding = version
        for i, k in zip(running, steps):
            self._spans[i].append((k, version))

    def _step(self, waiting: deque, running: list[int], budget: dict) -> None:
        candidates = list(running) + list(waiting)  # a sequence may be admitted and finish in one round
        self.engine.step(self._seqs, waiting, running, budget, self._results, self.capacity)
        for i in running:  # admitted in this round: its tokens so far are the current version's
            self._spans.setdefault(i, [(0, self._decoding)])
        finished = [i for i in candidates if self._results[i] is not None]
        if not finished:
            return
        for i in finished:
            self._results[i].versions = self._spans.pop(i, [(0, self._decoding)])
        with self._cond:
            for i in finished:
                budget.pop(i, None)
                self._left[self._owner[i]] -= 1
            self._cond.notify_all()
