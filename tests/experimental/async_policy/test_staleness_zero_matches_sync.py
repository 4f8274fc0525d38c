"""Fully async with staleness_threshold=0 and a sync every step is the synchronous schedule: same prompts, same
samples (the rollout pool is seeded like the colocated rollout), same weights -> the synchronous run's metrics.
The same holds across a checkpoint: the async run stops after 2 steps and a fresh process resumes it."""

from __future__ import annotations

import pytest

from tests.experimental.async_policy.async_utils import FAST, run_async
from tests.trainer.e2e_utils import run_main_ppo, train_records

STEPS = 4
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "actor/ppo_kl")


def test_staleness_zero_reproduces_the_synchronous_run_across_a_resume(tmp_path, monkeypatch):
    # One intra-op thread in every worker of both runs: the synchronous run has one worker, the async run two, and
    # on an idle host the thread split (verl.utils.device.cpu_threads_per_worker) would differ between them, and
    # with it the order of float reductions (CI pins 1 already).
    monkeypatch.setenv("VERL_CPU_THREADS", "1")
    common = FAST + ["algorithm.rollout_correction.bypass_mode=true"]
    _, sync = run_main_ppo(tmp_path / "sync",
                           common + ["trainer.launcher=local", f"trainer.total_training_steps={STEPS}"])
    zero = common + ["async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
                     "async_training.require_batches=1", "data.gen_batch_size=8", "trainer.save_freq=2"]
    work = tmp_path / "async"
    _, rec1 = run_async("fully_async", work, zero + ["trainer.total_training_steps=2"])
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    proc, rec2 = run_async("fully_async", work, zero + [f"trainer.total_training_steps={STEPS}",
                                                        "trainer.resume_mode=auto"])
    assert "Resuming from" in proc.stdout
    a, b = train_records(sync), train_records(rec1 + rec2)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert b[step]["fully_async/staleness/max"] == 0, step  # every sample on-policy
        assert b[step]["fully_async/count/current_param_version"] == step  # the version survives the resume
        for key in KEYS:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
    # the runs learn something: the policy moved (a zero update would match trivially)
    assert any(a[s]["actor/grad_norm"] > 0 for s in a)
