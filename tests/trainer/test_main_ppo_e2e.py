"""End-to-end runs of ``python -m verl.trainer.main_ppo`` on tiny Qwen3.5 models, on CPU, in-process launcher."""

from __future__ import annotations

import math

import pytest

from tests.trainer.e2e_utils import main_ppo_in_process, run_main_ppo, train_records

FAST = ["trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]


def test_grpo_with_kl_loss_and_kl_in_reward(tmp_path):
    # Both KL routes in one run (upstream lets them be on together): each logs its own metric every step.
    _, rec = run_main_ppo(tmp_path, FAST + ["trainer.total_training_steps=2",
                                            "actor_rollout_ref.actor.use_kl_loss=true",
                                            "actor_rollout_ref.actor.kl_loss_coef=0.01",
                                            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                                            "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    for s in steps.values():
        for key in ("actor/kl_loss", "actor/reward_kl_penalty"):
            assert key in s and math.isfinite(s[key]), key


def test_gae_with_critic_runs(tmp_path):
    _, rec = run_main_ppo(tmp_path, FAST + ["trainer.total_training_steps=2", "algorithm.adv_estimator=gae",
                                            "critic.ppo_micro_batch_size_per_gpu=16", "critic.optim.lr=1e-3"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    assert all("critic/vf_loss" in s and "critic/values/mean" in s for s in steps.values())
    # upstream's perf/mfu/{actor,critic}: the tiny model is far from the CPU's nominal peak, but not at zero
    for s in steps.values():
        assert 0 < s["perf/mfu/actor"] < 1 and 0 < s["perf/mfu/critic"] < 1, s


@pytest.mark.parametrize("kind", ["moe", "vl"])
def test_moe_and_vl_checkpoints_run_a_step(tmp_path, kind):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    model_dir = tmp_path / f"tiny-{kind}"
    build_tiny_qwen3_5(model_dir, kind=kind, seed=0)
    _, rec = run_main_ppo(tmp_path / "run", FAST + ["trainer.total_training_steps=2",
                                                    f"actor_rollout_ref.model.path={model_dir}"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    assert all(math.isfinite(s["actor/pg_loss"]) for s in steps.values())


def test_unknown_key_is_rejected_with_suggestion(tmp_path, monkeypatch, capsys):
    code, err = main_ppo_in_process(monkeypatch, capsys, tmp_path, ["actor_rollout_ref.actor.optim.lrr=1e-3"])
    assert code == 2
    assert "lrr" in err and "actor_rollout_ref.actor.optim.lr" in err


def test_missing_model_path_is_named(tmp_path, monkeypatch, capsys):
    code, err = main_ppo_in_process(monkeypatch, capsys, tmp_path,
                                    FAST + ["actor_rollout_ref.model.path=/nonexistent/model"])
    assert code != 0
    assert "/nonexistent/model" in err
