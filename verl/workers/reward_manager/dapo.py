"""DAPO's reward manager: the rule score plus the soft overlong penalty.

Responses longer than ``max_resp_len - overlong_buffer_cfg.len`` lose reward linearly, reaching
``-penalty_factor`` at ``max_resp_len``: a truncated answer is pushed towards brevity before it is cut off,
instead of being scored like a wrong one. Keys (upstream's, under ``reward.reward_kwargs``):
``overlong_buffer_cfg.{enable,len,penalty_factor,log}`` and ``max_resp_len``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from verl.workers.reward_manager.naive import NaiveRewardManager
from verl.workers.reward_manager.registry import register

if TYPE_CHECKING:
    from verl import DataProto

OVERLONG_KEYS = ("enable", "len", "penalty_factor", "log")


def _field(cfg, key: str, default=None):
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def overlong_penalty(response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """0 up to ``max_resp_len - buffer_len`` tokens, then ``-penalty_factor`` per buffer length beyond it."""
    exceed = response_length - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


@register("dapo")
class DAPORewardManager(NaiveRewardManager):
    """:class:`NaiveRewardManager` scoring plus the overlong penalty on each response's last token.

    Args (beyond the naive manager's):
        max_resp_len: the response length limit the penalty is measured against (usually
            ``data.max_response_length``); required when the penalty is on.
        overlong_buffer_cfg: mapping with ``enable``, ``len`` (buffer tokens), ``penalty_factor`` (default 1.0)
            and ``log`` (add ``overlong_reward`` / ``overlong`` to the reward extras, and so to the validation metrics).
    """

    def __init__(self, tokenizer, num_examine: int, compute_score=None, reward_fn_key: str = "data_source",
                 max_resp_len: int | None = None, overlong_buffer_cfg=None, compute_score_timeout: float | None = None,
                 reward_router_address: str | None = None, reward_model_tokenizer=None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"the dapo reward manager got unknown reward.reward_kwargs {sorted(kwargs)}; it takes "
                            "max_resp_len, overlong_buffer_cfg and compute_score_timeout")
        super().__init__(tokenizer, num_examine, compute_score=compute_score, reward_fn_key=reward_fn_key,
                         compute_score_timeout=compute_score_timeout, reward_router_address=reward_router_address,
                         reward_model_tokenizer=reward_model_tokenizer)
        unknown = sorted(set(overlong_buffer_cfg or {}) - set(OVERLONG_KEYS)) if overlong_buffer_cfg else []
        if unknown:
            raise ValueError(f"reward.reward_kwargs.overlong_buffer_cfg has unknown keys {unknown}; "
                             f"valid keys are {', '.join(OVERLONG_KEYS)}")
        self.overlong_enabled = bool(_field(overlong_buffer_cfg, "enable", False))
        self.buffer_len = int(_field(overlong_buffer_cfg, "len", 0))
        self.penalty_factor = float(_field(overlong_buffer_cfg, "penalty_factor", 1.0))
        self.log_overlong = bool(_field(overlong_buffer_cfg, "log", False))
        self.max_resp_len = max_resp_len
        if self.overlong_enabled:
            if max_resp_len is None:
                raise ValueError("reward.reward_kwargs.overlong_buffer_cfg.enable=true needs "
                                 "reward.reward_kwargs.max_resp_len (usually data.max_response_length)")
            if self.buffer_len <= 0:
                raise ValueError(f"reward.reward_kwargs.overlong_buffer_cfg.len must be > 0 when the overlong penalty "
                                 f"is on (got {self.buffer_len}); set overlong_buffer_cfg.enable=false to turn it off")
            if self.buffer_len > int(max_resp_len):
                raise ValueError(f"reward.reward_kwargs.overlong_buffer_cfg.len ({self.buffer_len}) must not exceed "
                                 f"max_resp_len ({max_resp_len})")

    def __call__(self, data: DataProto, return_dict: bool = False):
        if "rm_scores" in data.batch.keys():  # scored by a reward model: nothing of ours to add
            return super().__call__(data, return_dict=return_dict)
        result = super().__call__(data, return_dict=True)
        reward_tensor: torch.Tensor = result["reward_tensor"]
        extra: dict[str, list] = result["reward_extra_info"]
        response_len = data.batch["responses"].shape[-1]
        valid = data.batch["attention_mask"][:, -response_len:].sum(-1)
        if not extra:  # scalar scores: upstream reports them as `acc` too
            extra["acc"] = reward_tensor.sum(-1).tolist()
        if self.overlong_enabled:
            penalties, flags = [], []
            for i, n in enumerate(valid.tolist()):
                p = overlong_penalty(int(n), int(self.max_resp_len), self.buffer_len, self.penalty_factor)
                reward_tensor[i, max(int(n) - 1, 0)] += p
                penalties.append(p)
                flags.append(p < 0)
            if self.log_overlong:
                extra["overlong_reward"] = penalties
                extra["overlong"] = flags
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": extra}
        return reward_tensor
