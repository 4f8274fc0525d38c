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


def test_grpo_server_mode_through_main_ppo(tmp_path):
    """rollout.checkpoint_engine.backend=gloo: the engine runs as a server process fed over gloo."""
    from tests.vllm_testing import build_engine_checkpoint

    model = tmp_path / "model"
    build_engine_checkpoint(str(model), "dense")
    proc, rec = run_main_ppo(tmp_path / "run", [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
        f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=2", "trainer.launcher=local",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=2",
    ], timeout=1800)
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    assert all(math.isfinite(s["actor/pg_loss"]) for s in steps.values())


@pytest.mark.parametrize("kind", ["qwen2_5", "llama", "qwen3"])
def test_grpo_generic_causal_lm_with_vllm(tmp_path, kind):
    """Non-Qwen3.5 models: weights reach vLLM through its own HF-name loader every step."""
    from tests.generic_models import build_generic_lm
    from tests.trainer.test_generic_lm_grpo_e2e import generic_grpo_overrides

    model = tmp_path / "model"
    build_generic_lm(model, kind, tie=kind != "llama")
    _, rec = run_main_ppo(tmp_path / "run", [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        *generic_grpo_overrides(model),
    ], timeout=1800)
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    for s in steps.values():
        assert math.isfinite(s["actor/pg_loss"]) and s["response_length/mean"] > 0
