"""``main_ppo`` with Ulysses SP=2 on two Ray workers (one data-parallel group) trains exactly like one process.

Both runs have a single data-parallel rank, so they see the same batches and sampling seed; the SP run
splits every packed row over the two ranks. About 45 s on a 2-core CPU.
"""

from __future__ import annotations

import pytest

from tests.trainer.e2e_utils import run_main_ppo, train_records

pytest.importorskip("ray")

COMMON = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
          "trainer.total_training_steps=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
          "actor_rollout_ref.model.use_remove_padding=true"]


def test_ray_sp2_matches_single_process(tmp_path):
    _, ref = run_main_ppo(tmp_path / "sp1", COMMON + ["trainer.launcher=local"])
    _, sp = run_main_ppo(tmp_path / "sp2", COMMON + ["trainer.launcher=ray", "trainer.n_gpus_per_node=2",
                                                     "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
                         env_extra={"OMP_NUM_THREADS": "1"})
    a, b = train_records(ref), train_records(sp)
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=5e-4, abs=1e-6), (step, key)
