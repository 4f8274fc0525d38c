"""The reward manager upstream pairs with GDPO (``reward.reward_manager.name=gdpo``).

GDPO normalises each reward component on its own (``algorithm.gdpo_reward_keys``), so the scorer returns a
dict of components (``{"score": ..., "accuracy_reward": ..., "format_reward": ...}``) and every entry must
reach ``reward_extra_info``, where the estimator reads them. Scoring is the naive manager's; what differs, as
upstream's: a plain-number score is reported as the ``acc`` component, and the scorer's ``extra_info`` carries
the run's ``experiment_name`` (``trainer.experiment_name``).
"""

from __future__ import annotations

from typing import Any, Optional

from verl.workers.reward_manager.naive import NaiveRewardManager
from verl.workers.reward_manager.registry import register

__all__ = ["GDPORewardManager"]


@register("gdpo")
class GDPORewardManager(NaiveRewardManager):
    def __init__(self, tokenizer, num_examine: int, compute_score=None, reward_fn_key: str = "data_source",
                 compute_score_timeout: Optional[float] = None, experiment_name: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(tokenizer, num_examine, compute_score=compute_score, reward_fn_key=reward_fn_key,
                         compute_score_timeout=compute_score_timeout, **kwargs)
        self.experiment_name = experiment_name

    def _score_one(self, row: int, data_source, response_str: str, ground_truth, extra_info) -> tuple[float, dict]:
        if self.experiment_name is not None:
            extra_info = {**extra_info, "experiment_name": self.experiment_name}
        score, extras = super()._score_one(row, data_source, response_str, ground_truth, extra_info)
        return score, (extras or {"acc": score})
