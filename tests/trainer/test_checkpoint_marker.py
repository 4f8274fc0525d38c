"""A crash while saving a checkpoint must never leave that step marked as the latest."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from verl.trainer.ppo.ray_trainer import LATEST_FILE, RayPPOTrainer
from verl.trainer.ppo.dataloader import StepDataLoader


class _FakeActorGroup:
    world_size = 1

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def save_checkpoint(self, path, global_step=0):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model_world_size_1_rank_0.pt"), "w") as f:
            f.write("partial")
        if global_step == self.fail_at:
            raise RuntimeError("worker died mid-save")


def _trainer(tmp_path, group):
    t = RayPPOTrainer.__new__(RayPPOTrainer)  # only the checkpoint logic is exercised
    t.config = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path), "max_actor_ckpt_to_keep": None}})
    t.actor_rollout_wg = group
    t.use_critic = False
    t.train_dataloader = StepDataLoader(list(range(8)), batch_size=2, collate_fn=lambda x: x)
    return t


def test_failed_save_keeps_previous_latest(tmp_path):
    t = _trainer(tmp_path, _FakeActorGroup(fail_at=4))
    t.global_steps = 2
    t._save_checkpoint()
    assert (tmp_path / LATEST_FILE).read_text() == "2"
    t.global_steps = 4
    with pytest.raises(RuntimeError, match="mid-save"):
        t._save_checkpoint()
    assert (tmp_path / LATEST_FILE).read_text() == "2"  # step 4 is on disk but not marked
    t.config.trainer.resume_mode = "auto"
    assert t._find_resume_dir().endswith("global_step_2")


def test_dataloader_state_resumes_exact_order():
    data = list(range(10))
    a = StepDataLoader(data, batch_size=3, collate_fn=list, seed=7)
    it = iter(a)
    seen = [next(it), next(it)]
    state = a.state_dict()
    rest_a = list(it)
    b = StepDataLoader(data, batch_size=3, collate_fn=list, seed=7)
    b.load_state_dict(state)
    assert list(b) == rest_a
    assert len(seen) == 2 and sorted(sum(seen + rest_a, [])) != data  # drop_last drops one row per epoch
