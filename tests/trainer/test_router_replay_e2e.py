"""Router replay end to end: ``main_ppo`` GRPO on a tiny Qwen3.5 MoE, CPU, with R3 (the hf rollout records
routed_experts, the actor replays them) and R2 (old-log-prob pass records, update replays), against the same
run without replay. The rollout and the trainer share bf16 weights (fsdp_config.model_dtype=bf16), so the
decode loop's and the training forward's different kernels round differently and some tokens' top-k flips;
the rollout/trainer gap (training/rollout_probs_diff_*) is logged with and without replay."""

from __future__ import annotations

import math

import pytest

from tests.trainer.e2e_utils import run_main_ppo, train_records

pytestmark = pytest.mark.slow

RUN = ["trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.total_training_steps=2",
       "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16", "data.max_response_length=12"]
R3 = ["actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
R2 = ["actor_rollout_ref.actor.fsdp_config.router_replay.mode=R2"]
GAP = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("rr_moe")
    # 16 experts, top-4: more tokens sit near the top-k boundary than with the default 4 / top-2
    build_tiny_qwen3_5(path, kind="moe", seed=0, num_experts=16, num_experts_per_tok=4)
    return path


def _gap(tmp_path, moe_dir, name, extra):
    _, rec = run_main_ppo(tmp_path / name, RUN + [f"actor_rollout_ref.model.path={moe_dir}", *extra])
    steps = train_records(rec)
    assert sorted(steps) == [1, 2]
    assert all(math.isfinite(s["actor/pg_loss"]) for s in steps.values())
    return steps


def test_r3_and_r2_runs_and_the_gap(tmp_path, moe_dir):
    off = _gap(tmp_path, moe_dir, "off", [])
    r3 = _gap(tmp_path, moe_dir, "r3", R3)
    r2 = _gap(tmp_path, moe_dir, "r2", R2)
    for k in GAP:
        print(k, "step 1: no replay", off[1][k], "R3", r3[1][k], "R2", r2[1][k])
    # Step 1 of each run samples the same responses from the same weights; only the trainer's routing differs.
    # R3 routes the trainer's tokens as the rollout did, so its gap can only be the numerics of the same
    # routing: a route put on the wrong token would instead add a routing mismatch on top.
    assert r3[1]["training/rollout_probs_diff_max"] <= off[1]["training/rollout_probs_diff_max"] * 1.01
    assert r3[1]["training/rollout_probs_diff_mean"] <= off[1]["training/rollout_probs_diff_mean"] * 1.01
    # R2 replays the trainer's own routes in the update; its old log-probs are those of no replay
    for k in GAP:
        assert r2[1][k] == pytest.approx(off[1][k], rel=1e-6)
