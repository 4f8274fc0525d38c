"""The rollouter's schedule on a stand-in rollout pool (no Ray, no model): how far generation runs ahead of the
trainer, which weight version each chunk carries, and the staleness the trainer sees."""

from __future__ import annotations

import itertools
import math
import threading
import time

import pytest
import torch
from omegaconf import OmegaConf

from verl.experimental.async_policy.rollouter import Rollouter
from verl.experimental.async_policy.schedule import Schedule, fully_async_schedule, one_step_off_schedule


class FakePool:
    """Records installed versions; generation takes a little while so the trainer and rollouter interleave."""

    def __init__(self, load_s: float = 0.0):
        self.version = 0
        self.installed = []
        self.lock = threading.Lock()
        self.load_s = load_s

    def load_rollout_weights(self, weights, version):
        time.sleep(self.load_s)
        with self.lock:
            self.version = version
            self.installed.append(version)

    def rollout_rng_state(self):
        return [{"v": self.version}]


def _rollouter(schedule: Schedule, pool: FakePool, gen_s: float = 0.002) -> Rollouter:
    counter = itertools.count()

    def generate(batch_dict):
        time.sleep(gen_s)
        return {"chunk": batch_dict, "version": pool.version}, {}

    return Rollouter(schedule, generate, pool, iter(counter), lambda: {"consumed": 0})


def _train(rollouter: Rollouter, schedule: Schedule, steps: int, train_s: float = 0.005) -> list[list[int]]:
    """The trainer's loop: take a step's chunks, 'train', sync every trigger steps; staleness per chunk."""
    version, seen = 0, []
    for step in range(1, steps + 1):
        chunks, _ = rollouter.take(schedule.chunks_per_step)
        assert all(c.batch["version"] == c.version for c in chunks)  # chunk version = the pool's version
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


@pytest.mark.parametrize("threshold,trigger", [(1.0, 1), (0.5, 2), (2.0, 1)])
@pytest.mark.parametrize("gen_s,train_s", [(0.002, 0.006), (0.006, 0.002)])  # slower trainer / slower rollout
def test_fully_async_generation_per_version_is_bounded(threshold, trigger, gen_s, train_s):
    """Upstream's rule: at most (1 + threshold) * trigger * require_batches mini-batches are generated with one
    version, the chunks still queued at a sync counting against the new version's allowance."""
    schedule = fully_async_schedule(_cfg(staleness_threshold=threshold, trigger_parameter_sync_step=trigger,
                                         gen=2))
    assert schedule.chunks_per_step == 2 and schedule.chunk_prompts == 2
    assert schedule.max_per_version == int(2 * trigger * (1 + threshold))
    pool = FakePool()
    r = _rollouter(schedule, pool, gen_s=gen_s)
    sizes = []
    install = r._install_pending

    def watched_install():  # the queue left over when new weights go in, and what that version then makes
        sizes.append(r.queue_size())
        install()

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

    def generate(batch_dict):
        raise ValueError("boom")

    r = Rollouter(schedule, generate, FakePool(), iter(range(9)), dict)
    r.start()
    with pytest.raises(RuntimeError, match="rollouter failed: boom"):
        r.take(1)
    r.stop()


def test_gen_batch_size_must_divide_a_step():
    with pytest.raises(ValueError, match="data.gen_batch_size=3"):
        fully_async_schedule(_cfg(gen=3))
