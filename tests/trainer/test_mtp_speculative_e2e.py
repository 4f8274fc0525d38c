"""Speculative decoding with the MTP head end to end: ``main_ppo`` GRPO on a tiny Qwen3.5 with an MTP head, CPU,
the built-in rollout drafting with the head (``actor_rollout_ref.model.mtp.enable_rollout=true``,
``actor_rollout_ref.model.mtp.num_speculative_tokens=2``) while the MTP loss trains it
(``actor_rollout_ref.model.mtp.enable_train=true``). The run logs the acceptance figures every step; the head
the rollout drafts with is the live, trained one (the hf rollout generates with the actor's module)."""

from __future__ import annotations

import math

import pytest

from tests.trainer.e2e_utils import run_main_ppo, train_records

RUN = ["trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.total_training_steps=2",
       "data.max_response_length=12", "actor_rollout_ref.rollout.name=hf",
       "actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true"]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("spec_mtp")
    build_tiny_qwen3_5(path, kind="dense", seed=0, mtp_num_hidden_layers=1)
    return path


def test_grpo_with_mtp_speculative_rollout_logs_acceptance(tmp_path, mtp_dir):
    _, rec = run_main_ppo(tmp_path / "spec", RUN + [f"actor_rollout_ref.model.path={mtp_dir}",
                                                    "actor_rollout_ref.model.mtp.enable_rollout=true",
                                                    "actor_rollout_ref.model.mtp.num_speculative_tokens=2"])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    for s in steps.values():
        assert math.isfinite(s["actor/pg_loss"]) and math.isfinite(s["actor/mtp_losses/mtp_1_loss"])
        assert 0.0 <= s["rollout/spec_accept_rate"] <= 1.0
        assert 1.0 <= s["rollout/spec_accept_length"] <= 3.0
        assert 0.0 <= s["perf/hf_engine/spec_accept_rate"] <= 1.0
        # two drafts per verification step, and some steps ran
        assert s["perf/hf_engine/spec_draft_tokens"] == 2 * s["perf/hf_engine/spec_verify_steps"] > 0
        print("step", {k: v for k, v in s.items() if "spec_" in k})
