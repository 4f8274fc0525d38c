"""The dapo reward manager: rule score plus upstream's soft overlong penalty."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.models.tiny import build_tiny_tokenizer
from verl.trainer.ppo.reward import load_reward_manager
from verl.workers.reward_manager import DAPORewardManager, get_reward_manager_cls
from verl.workers.reward_manager.dapo import overlong_penalty


def _batch(lengths, resp_len=10):
    b = len(lengths)
    prompts = torch.full((b, 2), 3)
    responses = torch.full((b, resp_len), 4)
    mask = torch.zeros(b, 2 + resp_len, dtype=torch.long)
    mask[:, :2] = 1
    for i, n in enumerate(lengths):
        mask[i, 2:2 + n] = 1
    nt = {"data_source": np.array(["t"] * b, dtype=object),
          "reward_model": np.array([{"ground_truth": "x"} for _ in range(b)], dtype=object)}
    return DataProto.from_dict({"prompts": prompts, "responses": responses, "attention_mask": mask}, non_tensors=nt)


def _score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def test_overlong_penalty_formula():
    assert overlong_penalty(6, 10, 4, 1.0) == 0.0
    assert overlong_penalty(8, 10, 4, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(10, 10, 4, 2.0) == pytest.approx(-2.0)


def test_penalty_lands_on_the_last_token_and_is_logged():
    m = DAPORewardManager(build_tiny_tokenizer(), 0, compute_score=_score, max_resp_len=10,
                          overlong_buffer_cfg={"enable": True, "len": 4, "penalty_factor": 1.0, "log": True})
    out = m(_batch([3, 8, 10]), return_dict=True)
    r = out["reward_tensor"]
    assert r[0, 2] == pytest.approx(1.0) and r[1, 7] == pytest.approx(0.5) and r[2, 9] == pytest.approx(0.0)
    assert r.sum().item() == pytest.approx(1.5)
    assert out["reward_extra_info"]["overlong"] == [False, True, True]
    assert out["reward_extra_info"]["acc"] == [1.0, 1.0, 1.0]  # the rule score before the penalty


def test_disabled_penalty_is_the_plain_score():
    m = DAPORewardManager(build_tiny_tokenizer(), 0, compute_score=_score)
    assert m(_batch([10, 2])).sum().item() == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"overlong_buffer_cfg": {"enable": True, "len": 4}}, "max_resp_len"),
    ({"max_resp_len": 10, "overlong_buffer_cfg": {"enable": True, "len": 0}}, "len must be > 0"),
    ({"max_resp_len": 10, "overlong_buffer_cfg": {"enable": True, "len": 20}}, "must not exceed"),
    ({"overlong_buffer_cfg": {"enable": True, "lenght": 4}}, "unknown keys"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DAPORewardManager(build_tiny_tokenizer(), 0, compute_score=_score, **kwargs)


def test_selected_by_config_with_upstream_keys():
    cfg = OmegaConf.create({"reward": {"reward_manager": {"name": "dapo", "source": "register"},
                                       "reward_kwargs": {"max_resp_len": 10,
                                                         "overlong_buffer_cfg": {"enable": True, "len": 4,
                                                                                 "penalty_factor": 1.0, "log": False}}}})
    assert get_reward_manager_cls("dapo") is DAPORewardManager
    m = load_reward_manager(cfg, build_tiny_tokenizer(), num_examine=0, **cfg.reward.reward_kwargs)
    assert isinstance(m, DAPORewardManager) and m.overlong_enabled and m.buffer_len == 4
