"""Per-token weight versions -> per-sample staleness and its logged distribution; the default correction."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from verl.experimental.async_policy import staleness as st
from verl.protocol import DataProto


def _batch(versions, mask):
    return DataProto.from_dict(tensors={"rollout_weight_version": torch.tensor(versions),
                                        "response_mask": torch.tensor(mask)})


def test_staleness_reads_the_oldest_token_and_ignores_padding():
    b = _batch([[3, 3, 0], [1, 2, 2], [0, 0, 0]], [[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # row 0: padding's 0 is ignored; row 1: a response spanning two versions is as old as its oldest token;
    # row 2: no response tokens counts as fresh
    assert st.sample_staleness(b, 3).tolist() == [0, 2, 0]


def test_partial_metrics_read_each_responses_span_of_versions():
    # row 0: one version; row 1: continued across two syncs (1 -> 3); row 2: across one (2 -> 3); row 3: empty
    b = _batch([[2, 2, 0, 0], [1, 2, 3, 3], [2, 2, 3, 0], [0, 0, 0, 0]],
               [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]])
    m = st.partial_metrics(b, 3)
    assert m["fully_async/partial/total_partial_num"] == 2 and m["fully_async/partial/partial_ratio"] == 0.5
    assert m["fully_async/partial/max_partial_span"] == 2
    assert (m["fully_async/weight_version/min"], m["fully_async/weight_version/max"]) == (1, 3)
    # token ages: [1, 1], [2, 1, 0, 0], [1, 1, 0] -> 7 / 9
    assert abs(m["fully_async/staleness/token_mean"] - 7 / 9) < 1e-12
    assert st.sample_staleness(b, 3).tolist() == [1, 2, 1, 0]  # the bound counts a response's oldest token


def test_distribution_metrics():
    m = st.staleness_metrics(torch.tensor([0, 0, 1, 5]))
    assert m["fully_async/staleness/mean"] == 1.5 and m["fully_async/staleness/max"] == 5
    assert m["fully_async/staleness/frac_0"] == 0.5 and m["fully_async/staleness/frac_1"] == 0.25
    assert m["fully_async/staleness/frac_2"] == 0.0 and m["fully_async/staleness/frac_ge4"] == 0.25


def test_default_correction_only_for_stale_batches_without_a_user_choice():
    plain = OmegaConf.create({"rollout_is": None, "rollout_rs": None, "bypass_mode": False,
                              "rollout_is_threshold": 3.0})
    rc, applied = st.default_correction(plain, any_stale=True)
    assert applied and rc.rollout_is == "token" and rc.rollout_is_threshold == 3.0
    assert plain.rollout_is is None  # the run's config is left alone
    assert st.default_correction(plain, any_stale=False) == (plain, False)
    bypass = OmegaConf.create({"rollout_is": None, "bypass_mode": True})
    assert st.default_correction(bypass, any_stale=True) == (bypass, False)
    seq = OmegaConf.create({"rollout_is": "sequence", "bypass_mode": False})
    assert st.default_correction(seq, any_stale=True) == (seq, False)
