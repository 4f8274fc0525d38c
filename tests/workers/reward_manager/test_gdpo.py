"""reward.reward_manager.name=gdpo (issue 27): the manager upstream pairs with the GDPO estimator. Every
component of a dict score reaches reward_extra_info (where algorithm.gdpo_reward_keys reads them), a plain
score is the `acc` component, and the scorer sees trainer.experiment_name in extra_info."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.models.tiny import build_tiny_tokenizer
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.reward import load_reward_manager
from verl.workers.reward_manager import GDPORewardManager, NaiveRewardManager


def _batch(n=4, resp_len=3):
    mask = torch.ones(n, 2 + resp_len, dtype=torch.long)
    nt = {"data_source": np.array(["t"] * n, dtype=object),
          "reward_model": np.array([{"ground_truth": str(i % 2)} for i in range(n)], dtype=object),
          "extra_info": np.array([{"index": i} for i in range(n)], dtype=object),
          "uid": np.array(["a", "a", "b", "b"][:n], dtype=object)}
    return DataProto.from_dict({"prompts": torch.full((n, 2), 3), "responses": torch.full((n, resp_len), 4),
                                "attention_mask": mask}, non_tensors=nt)


SEEN = []


def _components(data_source, solution_str, ground_truth, extra_info=None):
    SEEN.append(extra_info.get("experiment_name"))
    acc = float(ground_truth == "1")
    fmt = 1.0 - acc if extra_info["index"] < 2 else acc
    return {"score": acc + fmt, "accuracy_reward": acc, "format_reward": fmt}


def test_selected_by_name_with_the_experiment_name_from_the_config():
    SEEN.clear()
    cfg = OmegaConf.create({"reward": {"reward_manager": {"name": "gdpo"}},
                            "trainer": {"experiment_name": "gdpo_run_7"}, "data": {}})
    manager = load_reward_manager(cfg, build_tiny_tokenizer(), num_examine=0)
    assert isinstance(manager, GDPORewardManager)
    manager.compute_score = _components
    out = manager(_batch(), return_dict=True)
    assert SEEN == ["gdpo_run_7"] * 4  # the naive manager passes no experiment name
    assert out["reward_extra_info"]["accuracy_reward"] == [0.0, 1.0, 0.0, 1.0]
    assert out["reward_extra_info"]["format_reward"] == [1.0, 0.0, 0.0, 1.0]


def test_components_drive_the_gdpo_advantage():
    out = GDPORewardManager(build_tiny_tokenizer(), 0, compute_score=_components)(_batch(), return_dict=True)
    data = _batch()
    data.batch["token_level_rewards"] = out["reward_tensor"]
    for key, values in out["reward_extra_info"].items():
        data.non_tensor_batch[key] = np.array(values, dtype=object)
    algo = OmegaConf.create({"gdpo_reward_keys": ["accuracy_reward", "format_reward"],
                             "gdpo_reward_weights": [1.0, 0.0]})
    adv = compute_advantage(data, "gdpo", config=algo).batch["advantages"][:, -1]
    assert adv[1] > 0 > adv[0] and adv[3] > 0 > adv[2]  # the accuracy winner of each group
    algo.gdpo_reward_weights = [0.0, 1.0]
    adv = compute_advantage(data, "gdpo", config=algo).batch["advantages"][:, -1]
    assert adv[0] > 0 > adv[1] and adv[3] > 0 > adv[2]  # the format winner of each group


def test_a_plain_score_is_the_acc_component():
    def plain(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    gdpo = GDPORewardManager(build_tiny_tokenizer(), 0, compute_score=plain)(_batch(2), return_dict=True)
    naive = NaiveRewardManager(build_tiny_tokenizer(), 0, compute_score=plain)(_batch(2), return_dict=True)
    assert gdpo["reward_extra_info"] == {"acc": [0.25, 0.25]} and naive["reward_extra_info"] == {}
    assert torch.equal(gdpo["reward_tensor"], naive["reward_tensor"])


def test_upstream_gdpo_keys_validate_with_it():
    from verl.trainer.config import compose_config

    cfg = compose_config("demo", ["algorithm.adv_estimator=gdpo", "reward.reward_manager.name=gdpo",
                                  "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]"])
    assert cfg.reward.reward_manager.name == "gdpo"
