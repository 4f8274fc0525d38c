"""metric_utils against hand-computed values, with a minimal DataProto stand-in."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl.trainer.ppo import metric_utils as mu


def make_batch(with_response_mask=True, as_tensordict=False, meta=None):
    # row 0: prompt 2 tokens (left padded), response 4/4 (hits the limit)
    # row 1: prompt 3/3 tokens (hits the limit), response 2/4
    attn = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    resp_mask = attn[:, 3:].float()
    tensors = {
        "prompts": torch.zeros(2, 3, dtype=torch.long),
        "responses": torch.zeros(2, 4, dtype=torch.long),
        "attention_mask": attn,
        "token_level_scores": torch.tensor([[0, 0, 0, 1.0], [0, 0.5, 0, 0]]),
        "token_level_rewards": torch.tensor([[0, 0, 0, 0.8], [0, 0.3, 0, 0]]),
        "advantages": torch.tensor([[1.0, 2, 3, 4], [5, 6, 100, 100]]),
        "returns": torch.tensor([[1.0, 0, 2, 1], [3, 1, -50, -50]]),
        "values": torch.tensor([[0.5, 0.5, 1.5, 1.0], [2.0, 1.5, 70, 70]]),
    }
    if with_response_mask:
        tensors["response_mask"] = resp_mask
    batch = TensorDict(tensors, batch_size=[2]) if as_tensordict else tensors
    return SimpleNamespace(batch=batch, non_tensor_batch={}, meta_info=meta or {})


@pytest.mark.parametrize("with_mask,as_td", [(True, False), (False, False), (True, True)])
def test_compute_data_metrics(with_mask, as_td):
    m = mu.compute_data_metrics(make_batch(with_mask, as_td), use_critic=True)
    assert m["critic/score/mean"] == pytest.approx(0.75)
    assert (m["critic/score/max"], m["critic/score/min"]) == (pytest.approx(1.0), pytest.approx(0.5))
    assert m["critic/rewards/mean"] == pytest.approx(0.55)
    assert m["critic/advantages/mean"] == pytest.approx(3.5)  # masked 100s excluded
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (6.0, 1.0)
    assert m["critic/returns/min"] == 0.0 and m["critic/returns/max"] == 3.0
    assert m["critic/values/max"] == 2.0
    r = np.array([1.0, 0, 2, 1, 3, 1])
    v = np.array([0.5, 0.5, 1.5, 1.0, 2.0, 1.5])
    expected_ev = 1 - np.var(r - v, ddof=1) / (np.var(r, ddof=1) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(expected_ev, rel=1e-5)
    assert m["response_length/mean"] == 3.0 and m["response_length/max"] == 4.0
    assert m["response_length/min"] == 2.0 and m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/mean"] == 2.5 and m["prompt_length/clip_ratio"] == 0.5
    assert m["response/aborted_ratio"] == 0.0


def test_compute_data_metrics_without_critic_and_extras():
    b = make_batch()
    b.non_tensor_batch["__num_turns__"] = np.array([2, 4])
    m = mu.compute_data_metrics(b, use_critic=False)
    assert not any(k.startswith("critic/values") for k in m) and "critic/vf_explained_var" not in m
    assert m["num_turns/mean"] == 3 and m["num_turns/max"] == 4 and m["num_turns/min"] == 2


def test_aborted_samples_excluded_from_scores():
    b = make_batch()
    b.batch["attention_mask"][1, 3:] = 0  # second response empty -> aborted
    b.batch["response_mask"][1] = 0
    m = mu.compute_data_metrics(b)
    assert m["critic/score/mean"] == pytest.approx(1.0)
    assert m["response/aborted_ratio"] == 0.5
    assert m["response_length_non_aborted/mean"] == 4.0


def test_timing_and_throughput():
    b = make_batch(meta={"global_token_num": [10, 20, 30]})
    timing = {"gen": 0.5, "update_actor": 1.1, "step": 3.0, "other": 1.0}
    m = mu.compute_timing_metrics(b, timing)
    assert {k for k in m if k.startswith("timing_s/")} == {f"timing_s/{k}" for k in timing}
    # 6 response tokens, 5 prompt tokens
    assert m["timing_per_token_ms/gen"] == pytest.approx(500 / 6)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(1100 / 11)
    assert "timing_per_token_ms/step" not in m and "timing_per_token_ms/other" not in m
    t = mu.compute_throughout_metrics(b, timing, n_gpus=2)
    assert t == {"perf/total_num_tokens": 60, "perf/time_per_step": 3.0, "perf/throughput": 10.0}


def test_bootstrap_and_majority():
    assert mu.bootstrap_metric([2, 2, 2], 2, [np.max, np.mean]) == [(2.0, 0.0), (2.0, 0.0)]
    a = mu.bootstrap_metric([0, 1, 5], 2, [np.max], seed=7)
    assert a == mu.bootstrap_metric([0, 1, 5], 2, [np.max], seed=7)
    data = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}]
    assert mu.calc_maj_val(data, vote_key="pred", val_key="val") == 0.9


def test_process_validation_metrics():
    sources = ["s", "s", "s", "s", "t"]
    uids = ["u1", "u1", "u2", "u2", "v"]
    infos = {"acc": [1.0, 0.0, 1.0, 1.0, 0.5], "pred": ["A", "B", "C", "C", "x"]}
    res = mu.process_validation_metrics(sources, uids, infos, seed=0)
    s = res["s"]["acc"]
    assert "pred" not in res["s"]  # string variables are skipped
    assert s["mean@2"] == pytest.approx(0.75)  # (0.5 + 1) / 2
    assert s["std@2"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    # u2 always 1; u1 best@2 ~ 3/4, worst@2 ~ 1/4, maj@2 ~ 1/2 (bootstrap, so loose tolerance)
    assert s["best@2/mean"] == pytest.approx(0.875, abs=0.03)
    assert s["worst@2/mean"] == pytest.approx(0.625, abs=0.03)
    assert s["maj@2/mean"] == pytest.approx(0.75, abs=0.03)
    assert dict(res["t"]["acc"]) == {"mean@1": 0.5}

    again = mu.process_validation_metrics(sources, uids, infos, seed=0)
    assert again["s"]["acc"]["best@2/mean"] == s["best@2/mean"]

    flat = mu.flatten_validation_metrics(res)
    # upstream rule: core var, name starts with mean/maj/best, at the largest N (so best@N/std too)
    for core in ("mean@2", "best@2/mean", "best@2/std", "maj@2/mean"):
        assert f"val-core/s/acc/{core}" in flat
    for aux in ("std@2", "worst@2/mean", "worst@2/std"):
        assert f"val-aux/s/acc/{aux}" in flat
    assert flat["val-core/t/acc/mean@1"] == 0.5


def test_process_validation_bootstrap_sizes_and_expected_counts():
    res = mu.process_validation_metrics(["d"] * 5, ["p"] * 5, {"reward": [1, 2, 3, 4, 5]})
    names = set(res["d"]["reward"])
    assert {"best@2/mean", "best@4/mean", "best@5/mean", "mean@5"} <= names and "best@8/mean" not in names
    assert res["d"]["reward"]["best@5/mean"] >= res["d"]["reward"]["best@2/mean"]

    res = mu.process_validation_metrics(
        ["s", "s"], ["u", "u"], {"acc": [1.0, 0.0]}, expected_acc_counts={("s", "u"): 4}
    )
    assert res["s"]["acc"]["mean@4"] == pytest.approx(0.25)  # two failed sessions count as 0
    assert res["s"]["acc_success_only"]["mean@2"] == pytest.approx(0.5)
