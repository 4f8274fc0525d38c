"""Staleness of the samples a trainer step consumes, and the off-policy correction applied by default.

A sample's staleness is the trainer's parameter version (weight syncs done) minus the oldest version among its
response tokens (``rollout_weight_version``, stamped per token by the rollout pool; padding is masked out). With
partial rollout a response may span versions (it went on across a weight sync): its oldest version is the one
the staleness bound and the metrics count, and :func:`partial_metrics` reports the spans (upstream's
``fully_async/partial/*``) and the token-level staleness.
"""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import OmegaConf, open_dict

from verl.protocol import DataProto
from verl.trainer.ppo import rollout_corr

VERSION_KEY = "rollout_weight_version"
HIST_BINS = 4  # frac_0 .. frac_3 and frac_ge4: the distribution, with a tail bin


def version_range(batch: DataProto, param_version: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, the oldest and the newest version among its response tokens (a response with no tokens
    carries no version: ``param_version``, i.e. fresh)."""
    versions = batch.batch[VERSION_KEY]
    mask = batch.batch["response_mask"].bool()
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(dim=-1).values
    newest = torch.where(mask, versions, torch.full_like(versions, -1)).max(dim=-1).values
    empty = ~mask.any(dim=-1)
    fresh = torch.full_like(oldest, param_version)
    return torch.where(empty, fresh, oldest), torch.where(empty, fresh, newest)


def sample_staleness(batch: DataProto, param_version: int) -> torch.Tensor:
    """Per-sample staleness (long, >= 0), counted from the sample's oldest token."""
    oldest, _ = version_range(batch, param_version)
    return (param_version - oldest).clamp(min=0)


def partial_metrics(batch: DataProto, param_version: int) -> dict[str, float]:
    """Responses that span weight versions (partial rollout) and the token-level staleness: upstream's
    ``fully_async/partial/{total_partial_num, partial_ratio, max_partial_span}`` (span: newest minus oldest
    version of a response), ``fully_async/weight_version/{min,max}`` over the step's response tokens, and
    ``fully_async/staleness/token_mean`` (the trainer's version minus each response token's, averaged)."""
    oldest, newest = version_range(batch, param_version)
    span = newest - oldest
    mask = batch.batch["response_mask"].bool()
    ages = (param_version - batch.batch[VERSION_KEY]).clamp(min=0)[mask].double()
    return {"fully_async/partial/total_partial_num": float((span > 0).sum()),
            "fully_async/partial/partial_ratio": (span > 0).double().mean().item(),
            "fully_async/partial/max_partial_span": float(span.max()),
            "fully_async/weight_version/min": float(oldest.min()),
            "fully_async/weight_version/max": float(newest.max()),
            "fully_async/staleness/token_mean": ages.mean().item() if ages.numel() else 0.0}


def staleness_metrics(staleness: torch.Tensor) -> dict[str, float]:
    s = staleness.double()
    out = {"fully_async/staleness/mean": s.mean().item(), "fully_async/staleness/max": s.max().item(),
           "fully_async/staleness/min": s.min().item()}
    for k in range(HIST_BINS):
        out[f"fully_async/staleness/frac_{k}"] = (staleness == k).double().mean().item()
    out[f"fully_async/staleness/frac_ge{HIST_BINS}"] = (staleness >= HIST_BINS).double().mean().item()
    return out


def default_correction(rc, any_stale: bool):
    """The rollout-correction section for a batch: the user's when they configured one (``bypass_mode``, which
    the asynchronous configs turn on as upstream does, or ``rollout_is`` / ``rollout_rs``); otherwise, when the
    batch holds stale samples, token-level truncated importance sampling pi_old / pi_rollout capped at
    ``rollout_is_threshold``, so samples from older weights are reweighted rather than trained on as if
    on-policy. Returns ``(section, applied_default)``."""
    bypass = bool(rc is not None and rc.get("bypass_mode", False))
    if not any_stale or bypass or rollout_corr.is_enabled(rc):
        return rc, False
    section = OmegaConf.create(OmegaConf.to_container(rc, resolve=True) if rc is not None else {})
    with open_dict(section):
        section.rollout_is = "token"
        if section.get("rollout_is_threshold") is None:
            section.rollout_is_threshold = 2.0
    return section, True


def default_correction_flag(applied: Optional[bool]) -> dict[str, float]:
    return {"fully_async/correction/default_is": float(bool(applied))}
