"""Training / validation metrics for the PPO trainer.

Functions take a DataProto-like ``batch``: only ``batch.batch[key]`` (tensors),
``batch.non_tensor_batch`` (numpy arrays) and ``batch.meta_info`` are used.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "reduce_metrics",
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughout_metrics",
    "fold_save_into_step",
    "bootstrap_metric",
    "calc_maj_val",
    "process_validation_metrics",
    "flatten_validation_metrics",
]

_NAN = float("nan")


def reduce_metrics(metrics: dict[str, list[Any]]) -> dict[str, Any]:
    """Kept for upstream imports; :func:`verl.utils.metric.reduce_metrics` is the one implementation."""
    from verl.utils.metric import reduce_metrics as _reduce

    return _reduce(metrics)


def _has(tensors, key: str) -> bool:
    try:
        return key in tensors.keys()
    except AttributeError:
        return key in tensors


def _compute_response_info(batch) -> dict[str, torch.Tensor]:
    """Per-sample prompt / response lengths (float), from explicit fields if present,
    else from ``attention_mask`` split at the response width."""
    tensors = batch.batch
    if _has(tensors, "prompt_length") and _has(tensors, "response_length"):
        return {"prompt_length": tensors["prompt_length"], "response_length": tensors["response_length"]}
    width = tensors["responses"].shape[-1]
    attn = tensors["attention_mask"]
    return {
        "prompt_length": attn[:, :-width].sum(-1).float(),
        "response_length": attn[:, -width:].sum(-1).float(),
    }


def _stats(prefix: str, values: torch.Tensor, what: str) -> dict[str, float]:
    """``prefix/mean|max|min``; NaN (with a warning) when nothing is selected."""
    if values.numel() == 0:
        logger.warning("No valid %s, returning NaN metrics", what)
        return {f"{prefix}/mean": _NAN, f"{prefix}/max": _NAN, f"{prefix}/min": _NAN}
    v = values.detach().float()
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def _length_stats(prefix: str, lengths: torch.Tensor, limit: int) -> dict[str, float]:
    out = _stats(prefix, lengths, prefix)
    # share of samples that hit the length limit (i.e. were truncated)
    out[f"{prefix}/clip_ratio"] = (lengths == limit).float().mean().item() if lengths.numel() else _NAN
    return out


def compute_data_metrics(batch, use_critic: bool = True) -> dict[str, Any]:
    """Score / reward / advantage / return / value / length statistics of a rollout batch.

    Scores and rewards are per-sequence sums over non-aborted samples (response
    length > 0); advantages, returns and values are taken over valid response
    tokens.  ``response_mask`` and ``prompts`` are optional (derived from
    ``attention_mask`` / its width when absent).
    """
    t = batch.batch
    width = t["responses"].shape[-1]
    if _has(t, "response_mask"):
        resp_mask = t["response_mask"].bool()
    else:
        resp_mask = t["attention_mask"][:, -width:].bool()
    max_prompt_len = t["prompts"].shape[-1] if _has(t, "prompts") else t["attention_mask"].shape[-1] - width

    info = _compute_response_info(batch)
    prompt_len, resp_len = info["prompt_length"], info["response_length"]
    aborted = resp_len == 0
    kept = ~aborted

    seq_score = t["token_level_scores"].sum(-1)
    seq_reward = t["token_level_rewards"].sum(-1)
    valid_returns = torch.masked_select(t["returns"], resp_mask)

    metrics: dict[str, Any] = {}
    metrics.update(_stats("critic/score", seq_score[kept], "scores"))
    metrics.update(_stats("critic/rewards", seq_reward[kept], "rewards"))
    metrics.update(_stats("critic/advantages", torch.masked_select(t["advantages"], resp_mask), "advantages"))
    metrics.update(_stats("critic/returns", valid_returns, "returns"))

    if use_critic:
        valid_values = torch.masked_select(t["values"], resp_mask)
        metrics.update(_stats("critic/values", valid_values, "values"))
        if valid_values.numel() > 0:
            # 1 - Var(R - V) / Var(R): 1 is a perfect critic, <= 0 no better than a constant
            resid_var = torch.var(valid_returns.float() - valid_values.float())
            ret_var = torch.var(valid_returns.float())
            metrics["critic/vf_explained_var"] = (1.0 - resid_var / (ret_var + 1e-5)).item()
        else:
            metrics["critic/vf_explained_var"] = _NAN

    metrics.update(_length_stats("response_length", resp_len, width))
    metrics.update(_length_stats("response_length_non_aborted", resp_len[kept], width))
    metrics["response/aborted_ratio"] = aborted.float().mean().item()
    metrics.update(_length_stats("prompt_length", prompt_len, max_prompt_len))

    extra = getattr(batch, "non_tensor_batch", None) or {}
    for key, name in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        if key in extra:
            arr = np.asarray(extra[key])
            metrics[f"{name}/min"] = arr.min()
            metrics[f"{name}/max"] = arr.max()
            metrics[f"{name}/mean"] = arr.mean()
    return metrics


def compute_timing_metrics(batch, timing_raw: dict[str, float]) -> dict[str, Any]:
    """``timing_s/<stage>`` for every stage, plus ``timing_per_token_ms/<stage>`` for the
    known stages: ``gen`` per response token; ``ref``, ``values``, ``adv``,
    ``update_critic``, ``update_actor`` per prompt+response token."""
    info = _compute_response_info(batch)
    n_resp = torch.sum(info["response_length"]).item()
    n_all = torch.sum(info["prompt_length"]).item() + n_resp
    tokens_for = {"gen": n_resp}
    tokens_for.update({s: n_all for s in ("ref", "values", "adv", "update_critic", "update_actor")})

    out = {f"timing_s/{name}": secs for name, secs in timing_raw.items()}
    for name, n_tok in tokens_for.items():
        if name in timing_raw:
            out[f"timing_per_token_ms/{name}"] = timing_raw[name] * 1000 / n_tok if n_tok > 0 else 0.0
    return out


def compute_throughout_metrics(batch, timing_raw: dict[str, float], n_gpus: int) -> dict[str, Any]:
    """Tokens processed in the step (``meta_info["global_token_num"]``), step time
    (``timing_raw["step"]``) and tokens / second / GPU."""
    n_tok = sum(batch.meta_info["global_token_num"])
    step = timing_raw["step"]
    return {
        "perf/total_num_tokens": n_tok,
        "perf/time_per_step": step,
        "perf/throughput": n_tok / (step * n_gpus),
    }


def fold_save_into_step(metrics: dict[str, Any], save_s: float, n_gpus: int) -> dict[str, Any]:
    """The step's time and throughput with the checkpoint save counted in, as upstream times it (its save runs
    inside the ``step`` timer; here it runs after the step's metrics, so that a preempted run can save the step
    it just finished)."""
    step = metrics["timing_s/step"] + save_s
    return {"timing_s/step": step, "perf/time_per_step": step,
            "perf/throughput": metrics["perf/total_num_tokens"] / (step * n_gpus)}


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[..., float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list:
    """(mean, std) of each ``reduce_fn`` over ``n_bootstrap`` resamples of size ``subset_size``
    drawn with replacement.  Seeds numpy's global RNG so results are reproducible."""
    np.random.seed(seed)
    pool = np.array(data, dtype=object)
    draws = np.random.choice(len(pool), size=(n_bootstrap, subset_size), replace=True)
    results = []
    for fn in reduce_fns:
        vals = np.fromiter((fn(pool[row]) for row in draws), dtype=np.float64, count=n_bootstrap)
        results.append((float(vals.mean()), float(vals.std())))
    return results


def calc_maj_val(data: list[dict[str, Any]], vote_key: str, val_key: str) -> float:
    """Value (``val_key``) of the first sample carrying the most frequent ``vote_key``;
    ties go to the vote seen first."""
    counts = Counter(d[vote_key] for d in data)
    winner = max(counts, key=counts.get)  # max() keeps the first maximal key (insertion order)
    return next(d[val_key] for d in data if d[vote_key] == winner)


def _bootstrap_sizes(n: int) -> list[int]:
    """Subset sizes 2, 4, 8, ... below ``n``, then ``n`` itself (empty for n <= 1)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _per_prompt_metrics(vals: list, preds, seed: int) -> dict[str, float]:
    n = len(vals)
    out = {f"mean@{n}": float(np.mean(vals))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(vals))
    use_vote = preds is not None and len(preds) == n and all(p is not None for p in preds)
    for k in _bootstrap_sizes(n):
        (best_m, best_s), (worst_m, worst_s) = bootstrap_metric(vals, k, [np.max, np.min], seed=seed)
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = best_m, best_s
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = worst_m, worst_s
        if use_vote:
            votes = [{"val": v, "pred": p} for v, p in zip(vals, preds, strict=True)]
            [(maj_m, maj_s)] = bootstrap_metric(
                votes, k, [partial(calc_maj_val, vote_key="pred", val_key="val")], seed=seed
            )
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = maj_m, maj_s
    return out


def _source_reports_acc(by_uid: Mapping) -> bool:
    return any(v is not None for per_var in by_uid.values() for v in per_var.get("acc", []))


def _pad_missing_acc(grouped: dict, expected_counts: Mapping) -> None:
    """Count sessions that never produced a result as failures (acc = 0).

    Only data sources that report ``acc`` at all are touched, so reward-only
    evaluators do not gain a synthetic accuracy.  The observed values are kept
    as ``acc_success_only``.
    """
    with_acc = {src for src in list(grouped) if _source_reports_acc(grouped[src])}
    for key, want in expected_counts.items():
        src, uid = key
        if src in with_acc:
            per_var = grouped[src][uid]
            observed = list(filter(lambda v: v is not None, per_var.get("acc", [])))
            missing = want - len(observed)
            per_var["acc_success_only"] = observed
            per_var["acc"] = observed + [0.0] * (missing if missing > 0 else 0)


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[str],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    expected_acc_counts: Optional[Mapping[tuple[str, str], int]] = None,
) -> dict:
    """Group validation results by data source and prompt uid and summarise them.

    For each numeric variable in ``infos_dict`` and each prompt with N responses:
    ``mean@N``, and when N > 1 ``std@N`` plus bootstrap ``best@k/{mean,std}``,
    ``worst@k/{mean,std}`` (and ``maj@k/{mean,std}`` when a ``pred`` variable
    exists) for k = 2, 4, ..., N.  Metrics are then averaged over prompts.
    ``None`` values are ignored; string variables are skipped.

    ``expected_acc_counts[(data_source, uid)]`` (for sources that report ``acc``)
    pads missing sessions with ``acc = 0`` and keeps the observed values as
    ``acc_success_only``.

    Returns ``{data_source: {variable: {metric_name: value}}}``.
    """
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids, strict=False)):
        for var, vals in infos_dict.items():
            grouped[source][uid][var].append(vals[i])

    if expected_acc_counts:
        _pad_missing_acc(grouped, expected_acc_counts)

    collected: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for src, by_uid in grouped.items():
        for per_var in by_uid.values():
            preds = per_var.get("pred")
            for var, raw in per_var.items():
                vals = [v for v in raw if v is not None]
                if not vals or isinstance(vals[0], str):
                    continue
                for name, value in _per_prompt_metrics(vals, preds, seed).items():
                    collected[src][var][name].append(value)

    result: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for src, by_var in collected.items():
        for var, by_name in by_var.items():
            for name, per_prompt in by_name.items():
                result[src][var][name] = np.mean(per_prompt)
    return result


def flatten_validation_metrics(data_src2var2metric2val: dict) -> dict[str, float]:
    """Name validation metrics the way the trainer logs them.

    ``val-core/<source>/<var>/<metric>`` for the core variable (``acc`` if present,
    else ``reward``) and metrics starting with mean/maj/best at the largest N;
    everything else goes under ``val-aux/``.
    """
    flat = {}
    for src, by_var in data_src2var2metric2val.items():
        core_var = "acc" if "acc" in by_var else "reward"
        for var, by_name in by_var.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in by_name)
            for name, value in by_name.items():
                is_core = (
                    var == core_var and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                )
                flat[f"{'val-core' if is_core else 'val-aux'}/{src}/{var}/{name}"] = value
    return flat

