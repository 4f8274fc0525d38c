"""DAPO dynamic sampling (``algorithm.filter_groups``): train only on prompts whose responses disagree.

A GRPO group whose responses all got the same score has zero advantage everywhere: it costs a forward and a
backward pass and teaches nothing. With ``filter_groups.enable`` the trainer keeps generating batches of
``data.gen_batch_size`` prompts, keeps the groups whose ``filter_groups.metric`` has non-zero spread, and
stops once ``data.train_batch_size`` prompts are kept (or fails at ``max_num_gen_batches``).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

__all__ = ["SCORE_METRICS", "group_metric_values", "kept_group_rows", "trim_to_groups"]

# Names that select the rule score itself (token_level_scores summed over the response, before any KL);
# any other name selects a per-sample reward_extra_info column (e.g. "acc").
SCORE_METRICS = ("reward", "score", "seq_reward", "seq_final_reward")


def group_metric_values(batch, metric: str) -> np.ndarray:
    """One float per row: the response's score, or the ``metric`` column the reward function reported."""
    if metric in SCORE_METRICS:
        return batch.batch["token_level_scores"].sum(-1).double().numpy()
    column = batch.non_tensor_batch.get(metric)
    if column is None:
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function reported no such per-sample value "
            f"(it reported {sorted(k for k in batch.non_tensor_batch if k not in ('uid',))}); use 'reward' for the "
            "score, or return a dict with this key from the scoring function")
    try:
        return np.asarray([float(v) for v in column], dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"algorithm.filter_groups.metric={metric!r}: values must be numbers ({err})") from None


def kept_group_rows(uids, values: np.ndarray) -> tuple[list[int], int, int]:
    """Row indices of the groups (same uid) whose values are not all equal, plus (kept groups, all groups).

    A group of one response has no spread to measure and is kept, as upstream does (rollout.n=1 then filters
    nothing)."""
    rows: "OrderedDict[str, list[int]]" = OrderedDict()
    for i, uid in enumerate(uids):
        rows.setdefault(uid, []).append(i)
    kept: list[int] = []
    n_kept = 0
    for idx in rows.values():
        vals = values[idx]
        if len(idx) == 1 or float(np.std(vals)) > 0:
            kept.extend(idx)
            n_kept += 1
    return kept, n_kept, len(rows)


def trim_to_groups(batch, num_groups: int):
    """The first ``num_groups`` whole groups of ``batch`` (rows of a group are contiguous)."""
    uids = batch.non_tensor_batch["uid"]
    seen: list = []
    for i, uid in enumerate(uids):
        if not seen or seen[-1] != uid:
            if len(seen) == num_groups:
                return batch[:i]
            seen.append(uid)
    return batch
