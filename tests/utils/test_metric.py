"""verl.utils.metric: upstream's reduction rules."""

import pytest
import torch

from verl.trainer.ppo import metric_utils
from verl.utils.metric import AggregationType, Metric, reduce_metrics


def test_reduce_by_name_and_in_place():
    m = {"loss": [1.0, 2.0, 3.0], "reward_max": [5.0, 8.0, 6.0], "err_min": [0.1, 0.05, 0.2]}
    out = reduce_metrics(m)
    assert out is m and out == {"loss": 2.0, "reward_max": 8.0, "err_min": 0.05}
    assert metric_utils.reduce_metrics({"a/max": [1, 4]}) == {"a/max": 4.0}  # the old import path agrees


def test_metric_objects_aggregate_by_their_type():
    s = Metric("sum", [1, 2])
    s.append(torch.tensor(3.0))
    assert reduce_metrics({"x_max": s}) == {"x_max": 6.0}  # a Metric ignores the name rule
    assert Metric(AggregationType.MIN, [3, 1]).aggregate() == 1
    with pytest.raises(ValueError, match="scalar"):
        Metric("mean", torch.ones(2))
    with pytest.raises(ValueError, match="unknown aggregation"):
        Metric("median")
    with pytest.raises(ValueError, match="cannot merge"):
        Metric("mean", 1).extend(Metric("max", 2))


def test_aggregate_over_data_parallel_ranks():
    ranks = [Metric("sum", [1.0, 3.0]), Metric("sum", [3.0, 5.0])]
    assert Metric.aggregate_dp(ranks) == pytest.approx(6.0)  # rank-mean per step (2, 4), then summed
    assert Metric.aggregate_dp([Metric("max", [1, 9]), Metric("max", [4, 2])]) == 9
    with pytest.raises(ValueError, match="same number"):
        Metric.aggregate_dp([Metric("mean", [1]), Metric("mean", [1, 2])])
