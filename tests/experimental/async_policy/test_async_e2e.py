"""The two asynchronous entry points end to end on the demo (tiny Qwen3.5, two one-CPU Ray resource pools)."""

from __future__ import annotations

import math

import pytest

from tests.experimental.async_policy.async_utils import FAST, run_async
from tests.trainer.e2e_utils import demo_dir, train_records


def test_one_step_off_policy_overlaps_one_step(tmp_path):
    overrides = [o for o in FAST if not o.startswith("trainer.test_freq=")]
    _, rec = run_async("one_step_off", tmp_path, overrides + ["trainer.total_training_steps=3", "trainer.test_freq=3"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2, 3]
    # validation runs on the rollout pool between chunks, with the newest synced weights
    assert any(k.startswith("val-core/") for k in steps[3]), sorted(steps[3])
    # step 1 trains on the batch generated before any update; every later batch is one weight version old
    assert steps[1]["fully_async/staleness/max"] == 0
    for s in (2, 3):
        assert steps[s]["fully_async/staleness/min"] == steps[s]["fully_async/staleness/max"] == 1
        assert steps[s]["fully_async/staleness/frac_1"] == 1.0
        assert steps[s]["fully_async/weight_version/max"] == s - 2
    assert any(s["actor/grad_norm"] > 0 for s in steps.values())  # (a step whose groups all tie has none)
    for s in steps.values():
        assert math.isfinite(s["actor/pg_loss"])
        assert s["fully_async/count/current_param_version"] >= 1
        assert 0.0 <= s["fully_async/rollouter/idle_ratio"] <= 1.0


def test_fully_async_applies_the_default_correction_to_stale_batches(tmp_path):
    """bypass_mode off and no correction named: stale batches get token-level TIS (rollout_corr/* logged).
    Chunks of 2 prompts, 4 per step: a step's chunks come from different trainer steps and weight versions."""
    _, rec = run_async("fully_async", tmp_path, FAST + [
        "data.gen_batch_size=2", "algorithm.rollout_correction.bypass_mode=false", "trainer.total_training_steps=3",
        "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2, 3]
    assert steps[1]["fully_async/correction/default_is"] == 0.0 and "rollout_corr/rollout_is_mean" not in steps[1]
    stale = [s for s in steps.values() if s["fully_async/staleness/max"] > 0]
    assert stale, steps
    for s in stale:
        assert s["fully_async/correction/default_is"] == 1.0 and math.isfinite(s["rollout_corr/rollout_is_mean"])


def test_fully_async_keeps_several_chunks_in_flight(tmp_path):
    """concurrent_samples_per_replica=4 over chunks of 2 prompts: two chunks in flight on the rollout pool, their
    sequences in one decode session; every chunk keeps the one weight version that generated it."""
    _, rec = run_async("fully_async", tmp_path, FAST + [
        "data.gen_batch_size=2", "trainer.total_training_steps=3", "async_training.staleness_threshold=1",
        "async_training.trigger_parameter_sync_step=1", "async_training.concurrent_samples_per_replica=4"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2, 3]
    assert all(s["fully_async/rollouter/pipeline_depth"] == 2 for s in steps.values())
    assert max(s["fully_async/rollouter/max_chunks_in_flight"] for s in steps.values()) == 2
    for s in steps.values():
        assert s["fully_async/staleness/max"] <= 1  # the threshold holds with chunks in flight
        # without partial rollout a sync never pauses chunks in flight, and no response spans two versions
        assert s["fully_async/rollouter/paused_at_sync"] == 0 and s["fully_async/partial/total_partial_num"] == 0
        assert math.isfinite(s["actor/pg_loss"])
        # the step's decode figures are sums over its chunks' stretches of the session
        assert 0 < s["perf/hf_engine/slot_steps"] <= s["perf/hf_engine/decode_steps"] * s["perf/hf_engine/slots"]


def test_fully_async_partial_rollout_continues_responses_across_syncs(tmp_path):
    """async_training.partial_rollout=true with two chunks in flight and responses of 128 tokens: weights go in
    while chunks decode (paused_at_sync, never drained_at_sync), the responses live at a sync go on with the new
    weights (fully_async/partial/*: each token carries its version), and the staleness bound, counted from a
    response's oldest token, holds."""
    # Whether a response is live at a sync is a race between the trainer's step and the decode. Responses that
    # always run to 128 tokens (ignore_eos) keep the rollout pool decoding at every sync from the second on, and
    # five steps leave two steps to train on the chunks paused there (a chunk goes into the queue behind up to a
    # step's worth of older chunks). With 64 tokens, EOS on and four steps, a loaded CI machine once saw none.
    _, rec = run_async("fully_async", tmp_path, FAST + [
        "data.gen_batch_size=2", "trainer.total_training_steps=5", "async_training.staleness_threshold=1",
        "async_training.trigger_parameter_sync_step=1", "async_training.concurrent_samples_per_replica=4",
        "async_training.partial_rollout=true", "data.max_response_length=128",
        "actor_rollout_ref.rollout.ignore_eos=true"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    for s in steps.values():
        assert s["fully_async/rollouter/partial_rollout"] == 1.0
        assert s["fully_async/rollouter/drained_at_sync"] == 0
        assert s["fully_async/staleness/max"] <= 1
        assert s["fully_async/weight_version/max"] - s["fully_async/weight_version/min"] >= \
            s["fully_async/partial/max_partial_span"]
        assert math.isfinite(s["actor/pg_loss"])
    assert sum(s["fully_async/rollouter/paused_at_sync"] for s in steps.values()) >= 1
    spanning = [s for s in steps.values() if s["fully_async/partial/total_partial_num"] > 0]
    assert spanning, steps  # some responses were live at a sync and went on with the new weights
    for s in spanning:
        assert s["fully_async/partial/max_partial_span"] >= 1 and 0 < s["fully_async/partial/partial_ratio"] <= 1
    # (a chunk's collect reports the session's work since the previous collect: the re-prefills at a pause may
    # land in another step's figures than the responses they continued)
    assert sum(s["perf/hf_engine/reprefills"] for s in steps.values()) > 0


@pytest.mark.parametrize("override,needle", [
    ("async_training.partial_rollout=true actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
     "enable_rollout_routing_replay"),
    ("trainer.launcher=local", "trainer.launcher"),
    ("--config-name fully_async_ppo_megatron_trainer actor_rollout_ref.rollout.name=hf "
     "actor_rollout_ref.model.path=/m data.train_files=/d data.val_files=/d", "strategy=megatron"),
    ("async_training.concurrent_samples_per_replica=0", "async_training.concurrent_samples_per_replica"),
])
def test_unsupported_settings_are_refused(monkeypatch, capsys, override, needle):
    # The entry point's main in process: the refusal happens while the config is validated, before Ray or a
    # worker starts, so a subprocess would only add an interpreter start-up (the `python -m` path and its exit
    # code are exercised by the runs above).
    from verl.experimental.fully_async_policy.fully_async_main import main

    monkeypatch.setenv("VERL_DEMO_DIR", demo_dir())
    monkeypatch.delenv("VERL_DEBUG", raising=False)
    code = main(override.split())
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert needle in err


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_demo_learns(tmp_path, mode):
    """The demo's learning bar (tests/trainer/test_demo.py) in each asynchronous mode, on its default config."""
    _, rec = run_async(mode, tmp_path, ["trainer.test_freq=-1", "trainer.val_before_train=false"], timeout=1500)
    steps = train_records(rec)
    scores = [s["critic/score/mean"] for _, s in sorted(steps.items())]
    if mode == "fully_async":  # the demo's chunks of 8 prompts, 16 per replica: two chunks in flight
        assert all(s["fully_async/rollouter/pipeline_depth"] == 2 for s in steps.values())
    assert len(scores) >= 20
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last - first >= 0.3, (first, last, scores)
