"""A 3-step GRPO run through the CLI with ``actor_rollout_ref.rollout.name=vllm`` (vLLM's CPU build)."""

from __future__ import annotations

import math

import pytest

from tests.trainer.e2e_utils import run_main_ppo, train_records

# CPU build: the GPU runs of the same path are scripts/gpu_vllm.sh's (realistic shapes, colocated CUDA vLLM).
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                                   reason="CPU build e2e; on CUDA see scripts/gpu_vllm.sh")]

# Engine-vs-trainer probabilities of the sampled tokens (``training/rollout_probs_diff_*`` = |p_trainer - p_engine|
# over response tokens). vLLM runs bf16 with its own CPU kernels, the trainer fp32: on the same weights
# test_vllm_rollout_engine allows a log-prob gap of 0.05 (and test_vllm_sync_matches_fresh 0.02), i.e.
# |dp| <= 0.05 * p; this tiny model, a few steps from random init, is near-uniform over 128 tokens (p ~ 0.01,
# far below 0.4), so max |dp| < 0.02 and mean < 1e-3 hold with room to spare.
# An engine left on the previous step's weights misses by one step's drift instead: one Adam step at the demo's
# lr 5e-3 moves these probabilities by ~0.05 at most and ~2.5e-3 on average (measured on this checkpoint with
# the entropy bonus alone; reward-driven steps move them more), so both bounds fail when the sync (or the
# wake-up before generating) does not happen.
PROBS_DIFF_MAX = 0.02
PROBS_DIFF_MEAN = 1e-3
# The entropy bonus gives every step a non-zero gradient, also when all of a group's rewards are equal (zero
# GRPO advantages, common for a random model): the policy then moves every step and a stale engine shows.
MOVING = "actor_rollout_ref.actor.entropy_coeff=0.01"


def assert_engine_tracks_trainer(steps: dict[int, dict]) -> None:
    """The gap metrics are logged on every step; from step 2 on (the first step after a weight sync) the
    engine samples from the trainer's current weights."""
    for step, s in sorted(steps.items()):
        assert s.get("training/rollout_probs_diff_valid") == 1, f"step {step}: no rollout log-probs to compare"
        for key in ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean"):
            assert key in s and math.isfinite(s[key]), f"step {step}: {key} not logged"
        assert s["actor/grad_norm"] > 0, f"step {step}: the policy did not move, the check below would be vacuous"
        if step >= 2:
            gap_max, gap_mean = s["training/rollout_probs_diff_max"], s["training/rollout_probs_diff_mean"]
            assert gap_max < PROBS_DIFF_MAX and gap_mean < PROBS_DIFF_MEAN, (
                f"step {step}: engine probabilities differ from the trainer's by max {gap_max:.4f} / mean "
                f"{gap_mean:.5f}: the engine is not on the trainer's weights (sync or wake-up not run)")


def test_grpo_three_steps_with_vllm_rollout(tmp_path):
    from tests.vllm_testing import build_engine_checkpoint

    model = tmp_path / "model"
    build_engine_checkpoint(str(model), "dense")  # head dims the CPU GDN kernel accepts
    _, rec = run_main_ppo(tmp_path / "run", [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=3", "trainer.launcher=local",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.n=4", MOVING,
    ], timeout=1800)
    steps = train_records(rec)
    assert sorted(steps) == [1, 2, 3]
    for s in steps.values():
        assert math.isfinite(s["actor/pg_loss"]) and s["response_length/mean"] > 0
    assert_engine_tracks_trainer(steps)


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
        "actor_rollout_ref.rollout.n=2", MOVING,
    ], timeout=1800)
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    assert all(math.isfinite(s["actor/pg_loss"]) for s in steps.values())
    assert_engine_tracks_trainer(steps)  # the sync crossed the process boundary over gloo


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
