"""scripts/gpu_async.py's figures from the file logger's records: samples/s over steps 2..N (step 1 compiles),
and the idle shares, the decode loop's empty slot-steps included."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def _step(i, step_s, gen_s, **extra):
    return {"step": i, "data": {"timing_s/step": step_s, "timing_s/gen": gen_s, "response_length/mean": 100.0,
                                "response_length/max": 400.0 + i, **extra}}


def test_summary_skips_the_first_step_and_counts_idle_slots():
    import gpu_async

    steps = [_step(1, 100.0, 50.0),
             _step(2, 10.0, 4.0, **{"perf/hf_engine/decode_steps": 100, "perf/hf_engine/slots": 8,
                                    "perf/hf_engine/slot_steps": 200}),
             _step(3, 30.0, 6.0, **{"perf/hf_engine/decode_steps": 50, "perf/hf_engine/slots": 4,
                                    "perf/hf_engine/slot_steps": 150, "fully_async/trainer/idle_ratio": 0.5})]
    s = gpu_async.summarize(steps, prompts=4, n=2)
    assert s["steps"] == 3 and s["samples_per_s"] == pytest.approx(16 / 40)
    assert s["step_s"] == pytest.approx(20.0) and s["gen_share"] == pytest.approx(5.0 / 20.0)
    assert s["slot_idle"] == pytest.approx(((1 - 200 / 800) + (1 - 150 / 200)) / 2)
    assert s["trainer_idle"] == pytest.approx(0.5) and s["rollout_idle"] is None
    assert s["response_max"] == 403.0
    assert s["update_s"] is None and s["export_s"] is None  # neither logged in these steps


def test_summary_splits_the_trainer_step():
    import gpu_async

    # the 2 x H200 reading of 2026-11-27: update 19.8 / 19.7 s, weight export 9.8 / 10.9 s
    steps = [_step(1, 159.4, 27.0),
             _step(2, 29.6, 0.0, **{"timing_s/update_actor": 19.8, "timing_s/sync_rollout_weights": 9.8}),
             _step(3, 30.6, 0.0, **{"timing_s/update_actor": 19.7, "timing_s/sync_rollout_weights": 10.9})]
    s = gpu_async.summarize(steps, prompts=16, n=8)
    assert s["update_s"] == pytest.approx(19.75) and s["export_s"] == pytest.approx(10.35)
    assert s["samples_per_s"] == pytest.approx(256 / 60.2)


def test_one_pool_is_refused():
    import gpu_async

    with pytest.raises(SystemExit):
        gpu_async.main(["--gpus", "1"])


def test_partial_rollout_flag_reaches_the_fully_async_launch():
    import argparse

    import gpu_async

    args = argparse.Namespace(prompts=8, n=2, gpus=2, max_prompt=64, max_response=32, device="cpu", steps=3,
                              chunk_prompts=0, concurrent_samples=0, staleness=0.5, partial_rollout=False,
                              rollout_name="hf")
    off = gpu_async.overrides(args, "fully_async", Path("m"), Path("d"))
    assert "async_training.partial_rollout=false" in off
    args.partial_rollout = True
    on = gpu_async.overrides(args, "fully_async", Path("m"), Path("d"))
    assert "async_training.partial_rollout=true" in on
    assert [o for o in on if "partial_rollout" not in o] == [o for o in off if "partial_rollout" not in o]
    assert not any("partial_rollout" in o for o in gpu_async.overrides(args, "sync", Path("m"), Path("d")))
    args.rollout_name = "vllm"  # --rollout-name: the engine of every mode
    for mode in ("sync", "one_step", "fully_async"):
        names = [o for o in gpu_async.overrides(args, mode, Path("m"), Path("d")) if o.startswith(
            "actor_rollout_ref.rollout.name=")]
        assert names == ["actor_rollout_ref.rollout.name=vllm"], (mode, names)


def test_summary_counts_paused_and_drained_syncs():
    import gpu_async

    steps = [_step(1, 10.0, 5.0), _step(2, 10.0, 5.0, **{"fully_async/rollouter/paused_at_sync": 1.0,
                                                           "fully_async/rollouter/sync_wait_s": 0.5,
                                                           "fully_async/partial/partial_ratio": 0.25}),
             _step(3, 10.0, 5.0, **{"fully_async/rollouter/paused_at_sync": 1.0,
                                    "fully_async/rollouter/drained_at_sync": 0.0,
                                    "fully_async/rollouter/sync_wait_s": 0.25,
                                    "fully_async/partial/partial_ratio": 0.75})]
    s = gpu_async.summarize(steps, prompts=4, n=2)
    assert (s["paused"], s["drained"]) == (2.0, 0.0)
    assert s["sync_wait_s"] == pytest.approx(0.75) and s["partial_ratio"] == pytest.approx(0.5)
