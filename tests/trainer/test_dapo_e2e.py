"""The embedded demo with DAPO dynamic sampling and rollout correction, run as a user would.

Every step must log the rollout/trainer gap (training/rollout_probs_diff_*), and with the built-in engine in
fp32 on CPU it must stay at most 1e-5: generation and the old-log-prob pass score the same tokens with the
same weights, temperature and positions."""

from __future__ import annotations

from tests.trainer.e2e_utils import run_main_ppo, train_records

GAP = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std")


def test_dapo_with_token_is_logs_new_metrics_and_a_tiny_gap(tmp_path):
    # The in-process launcher: dynamic sampling and the correction run in the controller and the gap in the
    # worker either way, and the Ray launcher's start-up is covered by the demo's own tests.
    proc, records = run_main_ppo(tmp_path, [
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.launcher=local", "algorithm.filter_groups.enable=True", "data.gen_batch_size=8",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "reward.reward_manager.name=dapo", "+reward.reward_kwargs.max_resp_len=6",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True", "+reward.reward_kwargs.overlong_buffer_cfg.len=2",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=True",
    ])
    steps = train_records(records)
    assert sorted(steps) == [1, 2], proc.stdout[-3000:]
    for step, m in steps.items():
        assert m["train/num_gen_batches"] >= 1
        for key in GAP:
            assert key in m, (step, sorted(m))
        assert 0.0 <= m["training/rollout_probs_diff_max"] <= 1e-5, (step, m["training/rollout_probs_diff_max"])
        assert m["rollout_corr/rollout_is_mean"] > 0
        assert "rollout_corr/rollout_rs_masked_fraction" in m and "rollout_corr/kl" in m
        # train_batch_size=16 prompts x rollout.n=8 survive the filter each step
        assert m["response_length/mean"] > 0 and m.get("critic/score/mean") is not None


def test_bypass_mode_trains_without_the_old_log_prob_pass(tmp_path):
    proc, records = run_main_ppo(tmp_path, [
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.launcher=local", "algorithm.rollout_correction.bypass_mode=True",
        "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.loss_type=reinforce",
    ])
    m = train_records(records)[1]
    assert "timing_s/old_log_prob" in m
    assert "rollout_corr/rollout_is_mean" in m  # computed inside the bypass loss, per micro-batch
    assert "training/rollout_probs_diff_max" not in m  # no trainer pass to compare with in bypass mode
