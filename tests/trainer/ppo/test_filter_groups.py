"""DAPO dynamic sampling: which groups survive, how batches accumulate, and the cap's error."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl.trainer.ppo import filter_groups
from verl.trainer.ppo.ray_trainer import RayPPOTrainer


def _batch(uids, scores, extra=None):
    scores_t = torch.zeros(len(uids), 3)
    scores_t[:, -1] = torch.tensor(scores, dtype=torch.float32)
    nt = {"uid": np.array(uids, dtype=object)}
    if extra is not None:
        nt.update({k: np.array(v, dtype=object) for k, v in extra.items()})
    return DataProto.from_dict({"token_level_scores": scores_t, "attention_mask": torch.ones(len(uids), 5)},
                               non_tensors=nt)


def test_groups_without_spread_are_dropped():
    rows, kept, total = filter_groups.kept_group_rows(["a", "a", "b", "b", "c"], np.array([1.0, 0.0, 1.0, 1.0, 0.0]))
    assert rows == [0, 1, 4] and (kept, total) == (2, 3)  # a disagrees, b does not, c is a group of one


def test_metric_from_reward_extra_info_and_clear_error():
    b = _batch(["a", "a"], [1.0, 1.0], extra={"acc": [1.0, 0.0]})
    assert filter_groups.group_metric_values(b, "acc").tolist() == [1.0, 0.0]
    assert filter_groups.group_metric_values(b, "reward").tolist() == [1.0, 1.0]
    with pytest.raises(KeyError, match="filter_groups.metric='pred'"):
        filter_groups.group_metric_values(b, "pred")


def test_trim_keeps_whole_groups():
    b = _batch(["a", "a", "b", "b", "c", "c"], [0, 1, 0, 1, 0, 1])
    assert list(filter_groups.trim_to_groups(b, 2).non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert len(filter_groups.trim_to_groups(b, 5)) == 6


def _trainer(batches, train_bs=2, cap=0):
    """A trainer with only what _dynamic_sample reads; generation returns the queued batches."""
    t = RayPPOTrainer.__new__(RayPPOTrainer)
    t.config = OmegaConf.create({"data": {"train_batch_size": train_bs},
                                 "algorithm": {"filter_groups": {"enable": True, "metric": "reward",
                                                                 "max_num_gen_batches": cap}}})
    queue = list(batches)
    t._batches = iter(range(100))
    t._generate_and_score = lambda batch_dict, timing, metrics: queue.pop(0)
    return t


def test_dynamic_sampling_accumulates_until_enough_prompts():
    first = _batch(["a", "a", "b", "b"], [1, 1, 0, 1])   # keeps b
    second = _batch(["c", "c", "d", "d"], [0, 0, 0, 0])  # keeps nothing
    third = _batch(["e", "e", "f", "f"], [1, 0, 1, 0])   # keeps e, f -> trimmed to e
    t = _trainer([second, third])
    metrics = {}
    out = t._dynamic_sample(first, {}, metrics)
    assert list(out.non_tensor_batch["uid"]) == ["b", "b", "e", "e"]
    assert metrics["train/num_gen_batches"] == 3


def test_dynamic_sampling_stops_at_the_cap_with_a_clear_message():
    flat = _batch(["a", "a"], [1, 1])
    t = _trainer([_batch(["b", "b"], [0, 0])], cap=2)
    with pytest.raises(RuntimeError, match=r"after 2 generation batches \(max_num_gen_batches=2\) only 0 of the 2"):
        t._dynamic_sample(flat, {}, {})
