"""Fully async with staleness_threshold=0 and a sync every step is the synchronous schedule: same prompts, same
samples (the rollout pool is seeded like the colocated rollout), same weights -> the same metrics."""

from __future__ import annotations

import pytest

from tests.experimental.async_policy.async_utils import FAST, run_async
from tests.trainer.e2e_utils import run_main_ppo, train_records

STEPS = 3
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "actor/ppo_kl")


def test_staleness_zero_reproduces_the_synchronous_run(tmp_path):
    common = FAST + [f"trainer.total_training_steps={STEPS}", "algorithm.rollout_correction.bypass_mode=true"]
    _, sync = run_main_ppo(tmp_path / "sync", common + ["trainer.launcher=local"])
    _, fa = run_async("fully_async", tmp_path / "async", common + [
        "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
        "async_training.require_batches=1", "data.gen_batch_size=8"])
    a, b = train_records(sync), train_records(fa)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert b[step]["fully_async/staleness/max"] == 0, step  # every sample on-policy
        for key in KEYS:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
    # the runs learn: the policy moved (a zero update would match trivially)
    assert any(abs(a[s]["actor/pg_loss"]) > 0 for s in a) and a[STEPS]["actor/grad_norm"] > 0
