"""On-policy distillation end to end: ``python -m verl.trainer.main_ppo`` with GRPO plus ``distillation.*`` on CPU,
a tiny Qwen3.5 student (the demo's checkpoint) and a tiny Qwen3.5 teacher of another seed, colocated (the teacher
runs on the reference's FSDP engine settings)."""

from __future__ import annotations

import math

import pytest

from tests.trainer.e2e_utils import main_ppo_in_process, run_main_ppo, train_records

# 128 responses a step (the demo's 16 prompts x 8), two optimizer steps of 64: the sampled-token KL estimate is
# noisy, and with fewer samples a few steps do not show its trend.
FAST = ["trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64", "actor_rollout_ref.actor.optim.lr=1e-2"]


@pytest.mark.slow
def test_grpo_with_distillation_pulls_the_student_to_the_teacher(tmp_path):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    teacher = tmp_path / "teacher"
    # The demo student is built with seed 0 at initializer_range 0.1; the teacher is another seed at a smaller
    # initializer range: a flatter distribution over the same vocabulary and tokenizer, which the student can
    # approach within a few steps (two random models of the same scale differ in a random function of the context,
    # which takes far more steps to copy).
    build_tiny_qwen3_5(teacher, kind="dense", seed=7, initializer_range=0.02)
    steps_n = 8
    _, rec = run_main_ppo(tmp_path / "run", FAST + [
        f"trainer.total_training_steps={steps_n}",
        "distillation.enabled=true",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.distillation_loss.loss_mode=k3",
        "distillation.distillation_loss.distillation_loss_coef=1.0",
    ])
    steps = train_records(rec)
    assert sorted(steps) == list(range(1, steps_n + 1))
    kl = [steps[s]["actor/distillation/loss"] for s in sorted(steps)]
    assert all(math.isfinite(x) and x >= 0 for x in kl), kl
    # The RL loss is still there (use_task_rewards=true by default) and the teacher ran as its own timed stage.
    assert all("actor/pg_loss" in steps[s] and "timing_s/teacher" in steps[s] for s in steps)
    # The student's reverse KL to the teacher (k3 on its own samples, measured before each update) falls.
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert last < 0.9 * first, kl


def test_a_missing_teacher_checkpoint_is_named_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    code, err = main_ppo_in_process(monkeypatch, capsys, tmp_path, FAST + [
        "distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/nonexistent/t"])
    assert code == 2, err[-2000:]
    assert "distillation.teacher_models.teacher_model.model_path=/nonexistent/t" in err
