"""The rollouter's schedule on a stand-in rollout pool (no Ray, no model): how far generation runs ahead of the
trainer, which weight version each chunk carries, and the staleness the trainer sees."""

from __future__ import annotations

import itertools
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from verl.experimental.async_policy.rollouter import Rollouter
from verl.experimental.async_policy.schedule import Schedule, fully_async_schedule, one_step_off_schedule


class FakePool:
    """A stand-in rollout pool with chunks in flight: a chunk takes ``gen_s`` from its submission (chunks in flight
    overlap, as in the engine's shared batch). It records installed versions, refuses weights while chunks are in
    flight unless told they may be (partial rollout), and notes the version at each chunk's start and end."""

    def __init__(self, load_s: float = 0.0, gen_s: float = 0.002, fail: bool = False):
        self.version = 0
        self.installed = []
        self.lock = threading.Lock()
        self.load_s, self.gen_s, self.fail = load_s, gen_s, fail
        self.in_flight = 0
        self.most_in_flight = 0
        self.rng = itertools.count()
        self.ahead = []  # what each run of chunks in flight was told it could grow to
        self.in_flight_at_install = []

    def load_rollout_weights(self, weights, version, in_flight=False):
        with self.lock:
            assert in_flight == (self.in_flight > 0), "in_flight must say whether chunks are in flight"
            self.in_flight_at_install.append(self.in_flight)
        time.sleep(self.load_s)
        with self.lock:
            self.version = version
            self.installed.append(version)

    def ready(self, handle, timeout):
        left = handle.started + self.gen_s - time.perf_counter()
        time.sleep(max(0.0, min(left, timeout)))
        return left <= timeout

    def submit(self, batch_dict, ahead):
        with self.lock:
            if self.in_flight == 0:
                self.ahead.append(ahead)
            self.in_flight += 1
            assert self.in_flight <= self.ahead[-1], "more chunks in flight than the run was sized for"
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            return SimpleNamespace(chunk=batch_dict, version=self.version, started=time.perf_counter(),
                                   rng_state=[next(self.rng)])

    def collect(self, handle):
        if self.fail:
            raise ValueError("boom")
        time.sleep(max(0.0, handle.started + self.gen_s - time.perf_counter()))
        with self.lock:
            self.in_flight -= 1
            return {"chunk": handle.chunk, "version": handle.version, "end_version": self.version}

    def finish(self, handle, out):
        return out, {}


def _rollouter(schedule: Schedule, pool: FakePool, gen_s: float = 0.002, depth: int = 1) -> Rollouter:
    pool.gen_s = gen_s
    return Rollouter(schedule, pool, iter(itertools.count()), lambda: {"consumed": 0}, depth=depth)


def _train(rollouter: Rollouter, schedule: Schedule, steps: int, train_s: float = 0.005) -> list[list[int]]:
    """The trainer's loop: take a step's chunks, 'train', sync every trigger steps; staleness per chunk."""
    version, seen = 0, []
    for step in range(1, steps + 1):
        chunks, _ = rollouter.take(schedule.chunks_per_step)
        assert all(c.batch["version"] == c.version for c in chunks)  # chunk version = the pool's version
        assert all(c.batch["end_version"] == c.version for c in chunks)  # ... from its start to its end
        seen.append([version - c.version for c in chunks])
        time.sleep(train_s)
        if step % schedule.trigger_parameter_sync_step == 0:
            version += 1
            rollouter.offer_weights([], version)
    return seen


def _cfg(**at):
    return OmegaConf.create({"data": {"train_batch_size": 4, "gen_batch_size": at.pop("gen", None)},
                             "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}},
                             "async_training": {"staleness_threshold": 0.0, "trigger_parameter_sync_step": 1,
                                                "require_batches": 2, **at}})


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("threshold,trigger", [(1.0, 1), (0.5, 2), (2.0, 1)])
@pytest.mark.parametrize("gen_s,train_s", [(0.002, 0.006), (0.006, 0.002)])  # slower trainer / slower rollout
def test_fully_async_generation_per_version_is_bounded(threshold, trigger, gen_s, train_s, depth):
    """Upstream's rule: at most (1 + threshold) * trigger * require_batches mini-batches are generated with one
    version, the chunks still queued at a sync counting against the new version's allowance."""
    schedule = fully_async_schedule(_cfg(staleness_threshold=threshold, trigger_parameter_sync_step=trigger,
                                         gen=2))
    assert schedule.chunks_per_step == 2 and schedule.chunk_prompts == 2
    assert schedule.max_per_version == int(2 * trigger * (1 + threshold))
    pool = FakePool()
    r = _rollouter(schedule, pool, gen_s=gen_s, depth=depth)
    sizes = []
    install = r._install_pending

    def watched_install(**kw):  # the queue left over when new weights go in, and what that version then makes
        sizes.append(r.queue_size())
        install(**kw)

    r._install_pending = watched_install
    r.start()
    try:
        seen = _train(r, schedule, steps=10, train_s=train_s)
    finally:
        r.stop()
    # every chunk the trainer took, by the version that generated it
    r_versions = [v for v in pool.installed]
    assert r_versions == sorted(r_versions)  # versions only move forward
    counts: dict[int, int] = {}
    version = 0
    for step, ages in enumerate(seen, start=1):
        version = (step - 1) // trigger
        for age in ages:
            counts[version - age] = counts.get(version - age, 0) + 1
    assert max(counts.values()) <= schedule.max_per_version, counts
    assert max(sizes, default=0) <= schedule.max_per_version
    if gen_s < train_s:  # a faster rollout really runs ahead: the trainer sees stale samples
        assert max(max(a) for a in seen) >= 1, seen


@pytest.mark.parametrize("threshold", [1.0, 2.0])
def test_leftover_is_counted_at_the_offer(threshold):
    """A fast rollout and a slow weight load: the trainer takes the queued chunks while the new weights load;
    those chunks still count against the new version's allowance, so staleness stays at ceil(threshold) (counting
    at the install would let one more version's worth run ahead)."""
    schedule = fully_async_schedule(_cfg(staleness_threshold=threshold, gen=2))
    pool = FakePool(load_s=0.01)
    r = _rollouter(schedule, pool, gen_s=0.001)
    r.start()
    try:
        seen = _train(r, schedule, steps=10, train_s=0.02)
    finally:
        r.stop()
    assert max(max(a) for a in seen) == math.ceil(threshold), seen


def test_staleness_zero_alternates_generation_and_training():
    schedule = fully_async_schedule(_cfg(gen=2))
    pool = FakePool()
    r = _rollouter(schedule, pool, gen_s=0.0)
    r.start()
    try:
        time.sleep(0.05)  # the rollouter stops after one step's chunks: the next needs new weights
        assert r.queue_size() == schedule.chunks_per_step
        seen = _train(r, schedule, steps=5)
    finally:
        r.stop()
    assert seen == [[0, 0]] * 5
    assert pool.installed[:4] == [1, 2, 3, 4]  # (the last offer may come after the rollouter stopped)


def test_one_step_off_runs_exactly_one_step_ahead():
    cfg = OmegaConf.create({"data": {"train_batch_size": 4, "gen_batch_size": None}})
    schedule = one_step_off_schedule(cfg)
    assert (schedule.chunks_per_step, schedule.max_queued, schedule.max_per_version) == (1, 1, None)
    pool = FakePool()
    r = _rollouter(schedule, pool, gen_s=0.0)
    r.start()
    try:
        seen = _train(r, schedule, steps=6, train_s=0.01)
    finally:
        r.stop()
    # step 1 trains on the first batch (version 0); every later batch was generated one version back
    assert seen == [[0]] + [[1]] * 5


def test_a_failing_generation_reaches_the_trainer():
    schedule = one_step_off_schedule(OmegaConf.create({"data": {"train_batch_size": 4}}))
    r = Rollouter(schedule, FakePool(fail=True), iter(range(9)), dict)
    r.start()
    with pytest.raises(RuntimeError, match="rollouter failed: boom"):
        r.take(1)
    r.stop()


def test_pipelined_rollouter_keeps_depth_chunks_in_flight():
    """Depth 3 on a slow pool: three chunks are in flight at once, each generated with one version (the pool
    refuses weights while any is in flight), and the metrics say so."""
    schedule = fully_async_schedule(_cfg(staleness_threshold=2.0, gen=2))
    assert schedule.max_per_version == 6
    pool = FakePool()
    r = _rollouter(schedule, pool, gen_s=0.03, depth=3)
    r.start()
    try:
        seen = _train(r, schedule, steps=6, train_s=0.001)
        util = r.read_utilization()
    finally:
        r.stop()
    assert pool.most_in_flight == 3
    # a run of chunks in flight is sized by what the version's allowance has left: never more than the depth,
    # and never less than what then ran together (FakePool.submit checks)
    assert max(pool.ahead) == 3 and min(pool.ahead) >= 1
    assert util["fully_async/rollouter/pipeline_depth"] == 3
    assert 1 <= util["fully_async/rollouter/max_chunks_in_flight"] <= 3
    assert max(max(a) for a in seen) <= 2  # staleness stays within the threshold


def test_exclusive_waits_for_the_chunks_in_flight():
    schedule = fully_async_schedule(_cfg(staleness_threshold=2.0, gen=2))
    pool = FakePool()
    r = _rollouter(schedule, pool, gen_s=0.02, depth=3)
    r.start()
    try:
        time.sleep(0.01)
        assert pool.in_flight > 0
        r.offer_weights([], 1)
        with r.exclusive():  # validation: the pool to itself, the offered weights installed
            assert pool.in_flight == 0 and pool.version == 1
            time.sleep(0.02)
            assert pool.in_flight == 0
    finally:
        r.stop()


def test_gen_batch_size_must_divide_a_step():
    with pytest.raises(ValueError, match="data.gen_batch_size=3"):
        fully_async_schedule(_cfg(gen=3))


def _train_partial(rollouter: Rollouter, schedule: Schedule, steps: int, train_s: float) -> list[list[int]]:
    """The trainer's loop with partial rollout: a chunk may end under newer weights than it started with."""
    version, seen = 0, []
    for step in range(1, steps + 1):
        chunks, _ = rollouter.take(schedule.chunks_per_step)
        for c in chunks:
            assert c.batch["version"] == c.version <= c.batch["end_version"] <= version
        seen.append([version - c.version for c in chunks])
        time.sleep(train_s)
        if step % schedule.trigger_parameter_sync_step == 0:
            version += 1
            rollouter.offer_weights([], version)
    return seen


@pytest.mark.parametrize("partial", [False, True])
def test_partial_rollout_installs_weights_without_draining(partial):
    """A slow rollout (chunks in flight at every sync): without partial rollout each install waits for the chunks
    in flight to finish (drained_at_sync); with it the weights go in while they decode (paused_at_sync), chunks
    end under newer weights than they started with, and the staleness bound (counted from a chunk's oldest
    version) still holds."""
    schedule = fully_async_schedule(_cfg(staleness_threshold=1.0, gen=2))
    pool = FakePool()
    r = Rollouter(schedule, pool, iter(itertools.count()), lambda: {"consumed": 0}, depth=3, partial=partial,
                  poll_s=0.005)
    pool.gen_s = 0.06
    r.start()
    try:
        seen = (_train_partial if partial else _train)(r, schedule, steps=6, train_s=0.001)
        util = r.read_utilization()
    finally:
        r.stop()
    assert max(max(a) for a in seen) <= 1
    assert util["fully_async/rollouter/partial_rollout"] == float(partial)
    assert util["fully_async/rollouter/syncs"] >= 1
    if partial:
        assert max(pool.in_flight_at_install) > 0  # weights went in with chunks in flight
        assert util["fully_async/rollouter/paused_at_sync"] >= 1
        assert util["fully_async/rollouter/drained_at_sync"] == 0
    else:
        assert pool.in_flight_at_install == [0] * len(pool.in_flight_at_install)
        assert util["fully_async/rollouter/paused_at_sync"] == 0
        assert util["fully_async/rollouter/drained_at_sync"] >= 1
