"""Reducing lists of per-micro-batch / per-rank metric values to one number per name.

Plain lists reduce by their name: a name containing ``max`` takes the maximum, ``min`` the minimum, anything
else the mean (so ``rollout_corr/rollout_is_max`` stays a maximum when ranks are merged). A :class:`Metric`
carries its own aggregation instead.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable, Union

import numpy as np
import torch

__all__ = ["AggregationType", "Metric", "reduce_metrics"]


class AggregationType(Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_REDUCERS = {
    AggregationType.MEAN: np.mean,
    AggregationType.SUM: np.sum,
    AggregationType.MIN: np.min,
    AggregationType.MAX: np.max,
}


def _scalar(value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a metric value must be a scalar; got a tensor of shape {tuple(value.shape)}")
        return value.detach().item()
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise ValueError(f"a metric value must be a scalar; got an array of shape {value.shape}")
        return value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"a metric value must be a number, got {type(value).__name__}")
    return value


class Metric:
    """Values of one metric and how to aggregate them (``mean``, ``sum``, ``min`` or ``max``)."""

    def __init__(self, aggregation: Union[str, AggregationType], value=None) -> None:
        try:
            self.aggregation = AggregationType(aggregation)
        except ValueError:
            raise ValueError(f"unknown aggregation {aggregation!r}; use one of "
                             f"{[a.value for a in AggregationType]}") from None
        self.values: list = []
        if value is not None:
            self.append(value)

    def append(self, value) -> None:
        if isinstance(value, Metric):
            self.extend(value)
        elif isinstance(value, (list, tuple)):
            self.extend(value)
        else:
            self.values.append(_scalar(value))

    def extend(self, values: Union["Metric", Iterable]) -> None:
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(f"cannot merge a {values.aggregation.value} metric into a "
                                 f"{self.aggregation.value} one")
            values = values.values
        for v in values:
            self.values.append(_scalar(v))

    def aggregate(self) -> float:
        if not self.values:
            raise ValueError("cannot aggregate a metric with no values")
        return float(_REDUCERS[self.aggregation](self.values))

    @classmethod
    def aggregate_dp(cls, per_rank: list["Metric"]) -> float:
        """Across data-parallel ranks that each hold one value per gradient-accumulation step: mean/sum
        aggregate the rank-averaged steps, min/max look at every value."""
        if not per_rank:
            raise ValueError("aggregate_dp needs at least one Metric")
        lengths = {len(m.values) for m in per_rank}
        if len(lengths) != 1:
            raise ValueError(f"every rank must hold the same number of values, got {sorted(lengths)}")
        agg = per_rank[0].aggregation
        table = np.asarray([m.values for m in per_rank], dtype=np.float64)
        if agg in (AggregationType.MEAN, AggregationType.SUM):
            return float(_REDUCERS[agg](table.mean(axis=0)))
        return float(_REDUCERS[agg](table))

    @classmethod
    def from_dict(cls, data: dict[str, Any], aggregation: Union[str, AggregationType]) -> dict[str, "Metric"]:
        return {k: cls(aggregation, v) for k, v in data.items()}

    def init_list(self) -> "Metric":
        """An empty metric with the same aggregation."""
        return Metric(self.aggregation)

    def __repr__(self) -> str:
        return f"Metric({self.aggregation.value}, {self.values})"


def reduce_metrics(metrics: dict[str, Union[Metric, list[Any]]]) -> dict[str, Any]:
    """Reduce each entry in place (and return the dict): a Metric by its aggregation, a list by its name."""
    for key, values in metrics.items():
        if isinstance(values, Metric):
            metrics[key] = values.aggregate()
        elif "max" in key:
            metrics[key] = float(np.max(values))
        elif "min" in key:
            metrics[key] = float(np.min(values))
        else:
            metrics[key] = float(np.mean(values))
    return metrics
