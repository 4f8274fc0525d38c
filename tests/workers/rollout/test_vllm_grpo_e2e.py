"""A 3-step GRPO run through the CLI with ``actor_rollout_ref.rollout.name=vllm`` (vLLM's CPU build)."""

from __future__ import annotations

import math

import pytest

from tests.trainer.e2e_utils import run_main_ppo, train_records

pytestmark = pytest.mark.vllm


def test_grpo_three_steps_with_vllm_rollout(tmp_path):
    from tests.vllm_testing import build_engine_checkpoint

    model = tmp_path / "model"
    build_engine_checkpoint(str(model), "dense")  # head dims the CPU GDN kernel accepts
    _, rec = run_main_ppo(tmp_path / "run", [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=3", "trainer.launcher=local",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.n=4",
    ], timeout=1800)
    steps = train_records(rec)
    assert sorted(steps) == [1, 2, 3]
    for s in steps.values():
        assert math.isfinite(s["actor/pg_loss"]) and s["response_length/mean"] > 0
