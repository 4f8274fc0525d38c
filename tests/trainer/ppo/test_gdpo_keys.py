"""algorithm.gdpo_reward_keys reach the GDPO estimator through the trainer's compute_advantage, and the
validator refuses GDPO without keys (or keys without GDPO)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage


def _batch(acc, fmt):
    n, prompt, resp = len(acc), 2, 3
    attention = torch.ones(n, prompt + resp, dtype=torch.long)
    data = DataProto.from_dict(
        tensors={"prompts": torch.zeros(n, prompt, dtype=torch.long),
                 "responses": torch.zeros(n, resp, dtype=torch.long),
                 "attention_mask": attention, "token_level_rewards": torch.zeros(n, resp)},
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object),
                     "accuracy": np.array(acc, dtype=object), "format": np.array(fmt, dtype=object)},
    )
    return data


def test_gdpo_reads_each_reward_key():
    algo = OmegaConf.create({"gdpo_reward_keys": ["accuracy", "format"], "gdpo_reward_weights": [1.0, 0.0]})
    out = compute_advantage(_batch([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]), "gdpo", config=algo)
    adv = out.batch["advantages"][:, -1]
    # weight 1 on accuracy, 0 on format: the accuracy winner of each group gets the positive advantage
    assert adv[0] > 0 > adv[1] and adv[2] > 0 > adv[3]
    algo.gdpo_reward_weights = [0.0, 1.0]
    adv = compute_advantage(_batch([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]), "gdpo", config=algo).batch["advantages"]
    assert adv[0, -1] < 0 < adv[1, -1]


def test_gdpo_key_missing_from_rewards_names_it():
    algo = OmegaConf.create({"gdpo_reward_keys": ["accuracy", "length"], "gdpo_reward_weights": None})
    with pytest.raises(ValueError, match="'length'"):
        compute_advantage(_batch([1.0, 0.0, 1.0, 0.0], [0.0] * 4), "gdpo", config=algo)


@pytest.mark.parametrize("overrides, key", [
    (["algorithm.adv_estimator=gdpo"], "algorithm.gdpo_reward_keys"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
     "algorithm.gdpo_reward_weights"),
    (["algorithm.adv_estimator=grpo", "algorithm.gdpo_reward_keys=[a,b]"], "algorithm.gdpo_reward_keys"),
])
def test_gdpo_keys_validated(overrides, key):
    from verl.trainer.config import ConfigValidationError, compose_config

    with pytest.raises(ConfigValidationError, match=f"`{key}`"):
        compose_config("demo", overrides + ["actor_rollout_ref.rollout.n=4"])


def test_gdpo_with_keys_validates():
    from verl.trainer.config import compose_config

    cfg = compose_config("demo", ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,fmt]"])
    assert list(cfg.algorithm.gdpo_reward_keys) == ["acc", "fmt"]
