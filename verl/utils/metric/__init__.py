"""Metric reduction helpers (upstream's ``verl.utils.metric``)."""

from .utils import AggregationType, Metric, reduce_metrics

__all__ = ["AggregationType", "Metric", "reduce_metrics"]
