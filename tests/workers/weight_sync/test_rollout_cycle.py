"""The hybrid-engine cycle the worker drives: sleep after generating, wake weights -> sync -> wake KV cache.

The rollout here is a recording STAND-IN for any BaseRollout (the vLLM engine's own sleep/wake is checked
with the real engine in tests/workers/rollout/test_vllm_sleep_cycle.py, -m vllm).
"""

from verl.workers.weight_sync.cycle import RolloutCycle


class _Recorder:
    def __init__(self, loses_weights=False):
        self.events = []
        self.weights_lost_in_sleep = False
        self._loses = loses_weights

    def sleep(self, tags):
        self.events.append(("sleep", tuple(tags)))
        self.weights_lost_in_sleep = self._loses

    def wake_up(self, tags):
        self.events.append(("wake", tuple(tags)))


def _cycle(rec):
    def sync():
        rec.events.append(("sync",))
        rec.weights_lost_in_sleep = False

    return RolloutCycle(rec, sync)


def test_order_weights_then_sync_then_kv_cache():
    rec = _Recorder()
    cycle = _cycle(rec)
    cycle.before_generate()  # first use: the engine has checkpoint (or dummy) weights -> sync
    cycle.after_generate()
    assert rec.events == [("wake", ("weights",)), ("sync",), ("wake", ("kv_cache",)),
                          ("sleep", ("weights", "kv_cache"))]


def test_sync_only_when_weights_changed():
    rec = _Recorder()
    cycle = _cycle(rec)
    cycle.before_generate()
    cycle.after_generate()
    rec.events.clear()
    cycle.before_generate()  # validation between updates: weights unchanged, kept through a level-1 sleep
    assert ("sync",) not in rec.events
    cycle.after_generate()
    cycle.weights_changed()  # actor update
    rec.events.clear()
    cycle.before_generate()
    assert rec.events == [("wake", ("weights",)), ("sync",), ("wake", ("kv_cache",))]


def test_a_sleep_that_discards_weights_forces_a_sync():
    rec = _Recorder(loses_weights=True)
    cycle = _cycle(rec)
    cycle.before_generate()
    cycle.after_generate()
    rec.events.clear()
    cycle.before_generate()  # nothing changed, but a level-2 sleep dropped the weights
    assert ("sync",) in rec.events


def test_a_dedicated_engine_never_sleeps_and_is_never_synced_by_the_cycle():
    """A rollout pool of its own (asynchronous modes): nothing to hand back to a trainer, and its weights arrive
    through load_rollout_weights, not the cycle."""
    rec = _Recorder()
    cycle = RolloutCycle(rec, lambda: rec.events.append(("sync",)), dedicated=True)
    cycle.weights_changed()
    cycle.before_generate()
    cycle.after_generate()
    assert rec.events == []


def test_a_released_copy_is_synced_before_the_next_generation():
    """The hf rollout on Megatron: after the engine's sleep the worker's ``release`` frees the engine's HF copy;
    the next generation must sync first even though the actor did not change (validation between updates)."""
    rec = _Recorder()
    freed = []
    cycle = RolloutCycle(rec, lambda: rec.events.append(("sync",)), release=lambda: freed.append(1) or True)
    cycle.before_generate()
    cycle.after_generate()
    assert rec.events[-1] == ("sleep", ("weights", "kv_cache")) and freed == [1]
    rec.events.clear()
    cycle.before_generate()
    assert rec.events == [("wake", ("weights",)), ("sync",), ("wake", ("kv_cache",))]


def test_a_release_that_frees_nothing_keeps_the_weights():
    rec = _Recorder()
    cycle = RolloutCycle(rec, lambda: rec.events.append(("sync",)), release=lambda: False)
    cycle.before_generate()
    cycle.after_generate()
    rec.events.clear()
    cycle.before_generate()
    assert ("sync",) not in rec.events


def test_the_sync_is_timed():
    import time

    rec = _Recorder()
    cycle = RolloutCycle(rec, lambda: time.sleep(0.05))
    cycle.before_generate()
    assert cycle.last_sync_s >= 0.05
    cycle.after_generate()
    cycle.before_generate()  # nothing changed: no sync, nothing timed
    assert cycle.last_sync_s == 0.0
