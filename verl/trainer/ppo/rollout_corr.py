"""Rollout correction: the rollout engine's sampling policy is not exactly the trainer's.

The engine (vLLM in bf16, a recurrent Gated DeltaNet kernel where training runs the chunked one, ...) samples
from pi_rollout while the loss is computed under pi_old (the trainer's old-log-prob pass). Upstream's
``algorithm.rollout_correction.*`` keys choose what to do about the gap; this module implements them on the
controller, between the old-log-prob pass and the actor update:

* ``rollout_is`` (``token`` | ``sequence``): truncated importance weights ``pi_old / pi_rollout`` (per token,
  or the product over the response), capped at ``rollout_is_threshold`` (TIS). A ``"lower_upper"`` string
  threshold zeroes weights outside the band instead (IcePop). The actor multiplies its per-token loss by them.
* ``rollout_rs``: rejection sampling, a comma list of ``{token|seq_sum|seq_mean|seq_max}_{k1|k2|k3}``; tokens
  (or whole responses) whose divergence statistic is out of bounds leave the loss mask.
* ``bypass_mode``: skip the old-log-prob pass and use the rollout's log-probs as pi_old; the loss
  (``bypass_mode`` policy loss below) then measures the ratio against the rollout policy directly.

Every step also logs the gap itself (``training/rollout_probs_diff_{max,mean,std}``, upstream's debug
metrics: absolute differences of the sampled tokens' probabilities) whether or not a correction is on.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from verl.trainer.ppo.policy_loss import compute_policy_loss_reinforce, compute_policy_loss_vanilla
from verl.utils.py_functional import config_get
from verl.utils.torch_functional import masked_mean, masked_sum

__all__ = [
    "RS_OPTIONS",
    "apply_rollout_correction",
    "compute_is_weights",
    "compute_offpolicy_metrics",
    "compute_policy_loss_bypass_mode",
    "compute_rejection_mask",
    "parse_is_threshold",
    "parse_rs",
    "parse_rs_thresholds",
    "prepare_bypass_config",
    "rollout_probs_diff_metrics",
]

# exp() of a log-ratio beyond this overflows float32 long before it means anything.
_LOG_BOUND = 20.0
RS_AGGREGATIONS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_DIVERGENCES = ("k1", "k2", "k3")
RS_OPTIONS = tuple(f"{a}_{d}" for a in RS_AGGREGATIONS for d in RS_DIVERGENCES if not (a == "seq_max" and d == "k1"))
IS_LEVELS = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


# ----------------------------------------------------------------------------- the gap, every step


def rollout_probs_diff_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor) -> dict[str, float]:
    """|p_trainer - p_rollout| of the sampled tokens over response tokens: max, mean, std, and the Pearson
    correlation of the two probabilities (upstream's debug metrics and names)."""
    mask = response_mask.bool()
    if not mask.any():
        nan = float("nan")
        return {"training/rollout_probs_diff_valid": 0, "training/rollout_probs_diff_max": nan,
                "training/rollout_probs_diff_mean": nan, "training/rollout_probs_diff_std": nan,
                "training/rollout_actor_probs_pearson_corr": nan}
    p_train, p_roll = old_log_probs.double().exp()[mask], rollout_log_probs.double().exp()[mask]
    diff = (p_train - p_roll).abs()
    corr = torch.corrcoef(torch.stack([p_train, p_roll]))[0, 1].item() if diff.numel() > 1 else float("nan")
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0,
        "training/rollout_actor_probs_pearson_corr": corr,
    }


# ----------------------------------------------------------------------------- thresholds


def _bounds_from_string(spec: str, what: str) -> tuple[Optional[float], float]:
    text = spec.strip()
    if not text:
        raise ValueError(f"{what} must not be an empty string")
    parts = text.split("_")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"{what}={spec!r}: expected a number or 'lower_upper' (e.g. '0.5_2.0')") from None
    if len(values) == 1:
        return None, values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise ValueError(f"{what}={spec!r}: expected a number or 'lower_upper' (e.g. '0.5_2.0')")


def parse_is_threshold(spec) -> tuple[float, Optional[float]]:
    """``rollout_is_threshold`` -> (upper, lower or None). A float is the TIS cap; ``"lo_hi"`` is an IcePop band."""
    if isinstance(spec, bool) or spec is None:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be a number or 'lower_upper', got {spec!r}")
    if isinstance(spec, (int, float)):
        lower, upper = None, float(spec)
    elif isinstance(spec, str):
        lower, upper = _bounds_from_string(spec, "algorithm.rollout_correction.rollout_is_threshold")
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be a number or 'lower_upper', "
                         f"got {type(spec).__name__}")
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={spec!r}: need 0 < lower <= upper")
    return upper, lower


def parse_rs(rs) -> list[str]:
    options = [o.strip() for o in str(rs).split(",") if o.strip()] if rs is not None else []
    options = list(dict.fromkeys(options))
    bad = [o for o in options if o not in RS_OPTIONS]
    if not options or bad:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={rs!r}: options must be a comma list of "
                         f"{', '.join(RS_OPTIONS)}")
    return options


def parse_rs_thresholds(options: list[str], spec) -> dict[str, tuple[Optional[float], float]]:
    """One threshold per option (or one shared): k1 options take ratio bounds ``lo_hi`` (a single value u
    means ``1/u_u``); k2/k3 take an upper bound on the divergence."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None or isinstance(spec, bool):
        raise ValueError(f"{key} must be set when rollout_rs is ({', '.join(options)})")
    items = [spec] if isinstance(spec, (int, float)) else [s for s in str(spec).split(",") if s.strip()]
    if len(items) == 1:
        items = items * len(options)
    if len(items) != len(options):
        raise ValueError(f"{key}={spec!r}: give one threshold, or one per rollout_rs option ({len(options)})")
    out = {}
    for option, item in zip(options, items):
        lower, upper = (None, float(item)) if isinstance(item, (int, float)) else _bounds_from_string(item, key)
        if option.endswith("k1"):
            lower = 1.0 / upper if lower is None else lower
            if not 0 < lower <= upper:
                raise ValueError(f"{key} for {option}: need ratio bounds 0 < lower <= upper, got {item!r}")
        elif lower is not None or not upper > 0:
            raise ValueError(f"{key} for {option}: a divergence option takes one positive upper bound, got {item!r}")
        out[option] = (lower, upper)
    return out


# ----------------------------------------------------------------------------- importance weights


def compute_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, threshold,
                       batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated (TIS) or band-limited (IcePop) importance weights ``pi_old / pi_rollout``, detached."""
    if level not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}; valid values are token, sequence")
    upper, lower = parse_is_threshold(threshold)
    mask = response_mask.to(log_ratio.dtype)
    if level == "token":
        per_unit = log_ratio  # one ratio per token
    else:
        per_unit = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)  # one ratio per response
    raw = per_unit.clamp(-_LOG_BOUND, _LOG_BOUND).exp().expand_as(log_ratio) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    weights = weights.detach()
    metrics = _is_metrics(weights, raw, mask, upper, lower if lower is not None else 1.0 / upper, level)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            seq = mask.sum(-1) > 0
            mean = masked_mean(weights, mask, axis=-1)[seq].mean() if seq.any() else weights.new_tensor(0.0)
        factor = mean.item() if mean.item() > 1e-8 else 1.0
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _is_metrics(weights, raw, mask, upper, lower, level) -> dict[str, float]:
    bmask = mask.bool()
    if not bmask.any():
        return {}
    out = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "token":
        out["rollout_is_max"] = weights[bmask].max().item()
        out["rollout_is_min"] = weights[bmask].min().item()
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(mask.dtype), mask).item()
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(mask.dtype), mask).item()
    else:
        rows = bmask.any(-1)
        # raw is zero at padding; the first valid position carries the response's ratio
        first = bmask.float().argmax(-1)
        seq_raw = raw.gather(-1, first.unsqueeze(-1)).squeeze(-1)[rows]
        seq_w = weights.gather(-1, first.unsqueeze(-1)).squeeze(-1)[rows]
        out["rollout_is_max"] = seq_raw.max().item()
        out["rollout_is_min"] = seq_raw.min().item()
        out["rollout_is_ratio_fraction_high"] = (seq_raw > upper).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (seq_raw < lower).float().mean().item()
        out["rollout_is_seq_mean"] = seq_w.mean().item()
        out["rollout_is_seq_std"] = seq_w.std().item() if seq_w.numel() > 1 else 0.0
        out["rollout_is_seq_max"] = seq_w.max().item()
        out["rollout_is_seq_min"] = seq_w.min().item()
    w = weights[bmask]
    out["rollout_is_std"] = w.std().item() if w.numel() > 1 else 0.0
    # Effective sample size of the weights, as a fraction of the tokens: 1 when every weight is equal.
    denom = (w.square().mean() * w.numel()).item()
    out["rollout_is_eff_sample_size"] = (w.sum().item() ** 2 / denom / w.numel()) if denom > 0 else 0.0
    return out


# ----------------------------------------------------------------------------- rejection sampling


def _divergence(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return -log_ratio  # bounds apply to the ratio exp(-k1) = pi_old / pi_rollout
    if kind == "k2":
        return 0.5 * log_ratio.square()
    lr = log_ratio.clamp(-_LOG_BOUND, _LOG_BOUND)
    return lr.exp() - 1.0 - lr


def compute_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, rs, threshold
                           ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss mask with out-of-bounds tokens (``token_*``) or responses (``seq_*``) removed."""
    options = parse_rs(rs)
    bounds = parse_rs_thresholds(options, threshold)
    mask = response_mask.to(log_ratio.dtype)
    keep = mask.bool().clone()
    metrics: dict[str, float] = {}
    for option in options:
        agg, kind = option.rsplit("_", 1)
        stat = _divergence(log_ratio, kind) * mask
        if agg == "seq_sum":
            stat = stat.sum(-1, keepdim=True)
        elif agg == "seq_mean":
            stat = (stat.sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)
        elif agg == "seq_max":
            stat = stat.masked_fill(~mask.bool(), float("-inf")).amax(-1, keepdim=True)
        lower, upper = bounds[option]
        if kind == "k1":  # ratio bounds on exp(-stat)
            ratio = (-stat).clamp(-_LOG_BOUND, _LOG_BOUND).exp()
            ok = (ratio >= lower) & (ratio <= upper)
        else:
            ok = stat <= upper
        ok = ok.expand_as(keep)
        option_keep = ok & mask.bool()
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean((~option_keep).to(mask.dtype), mask).item()
        rows = mask.bool().any(-1)
        seq_rejected = (mask.bool() & ~option_keep).any(-1)[rows]
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = seq_rejected.float().mean().item() if rows.any() else 0.0
        keep &= option_keep
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep).to(mask.dtype) * mask, mask).item()
    rows = mask.bool().any(-1)
    metrics["rollout_rs_seq_masked_fraction"] = ((mask.bool() & ~keep).any(-1)[rows].float().mean().item()
                                                 if rows.any() else 0.0)
    return keep.to(response_mask.dtype), metrics


# ----------------------------------------------------------------------------- off-policy diagnostics


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                              response_mask: torch.Tensor) -> dict[str, float]:
    """KL, perplexities and chi-square of pi_old vs pi_rollout (upstream's ``rollout_corr/`` diagnostics)."""
    mask = response_mask.to(old_log_prob.dtype)
    rows = mask.sum(-1) > 0
    if not rows.any():
        return {}
    train_mean = masked_mean(old_log_prob, mask, axis=-1)[rows]
    roll_mean = masked_mean(rollout_log_prob, mask, axis=-1)[rows]
    log_ratio = old_log_prob - rollout_log_prob
    safe = log_ratio.clamp(-_LOG_BOUND, _LOG_BOUND)
    seq_sum = masked_sum(log_ratio, mask, axis=-1)[rows].clamp(-_LOG_BOUND, _LOG_BOUND)
    diff = roll_mean - train_mean
    return {
        "training_ppl": (-train_mean).exp().mean().item(),
        "training_log_ppl": (-train_mean).mean().item(),
        "rollout_ppl": (-roll_mean).exp().mean().item(),
        "rollout_log_ppl": (-roll_mean).mean().item(),
        "kl": masked_mean(-log_ratio, mask).item(),
        "k3_kl": masked_mean(safe.exp() - 1.0 - safe, mask).item(),
        "log_ppl_diff": diff.mean().item(),
        "log_ppl_abs_diff": diff.abs().mean().item(),
        "log_ppl_diff_max": diff.max().item(),
        "log_ppl_diff_min": diff.min().item(),
        "ppl_ratio": diff.exp().mean().item(),
        "chi2_token": (masked_mean((2 * safe).exp(), mask) - 1.0).item(),
        "chi2_seq": ((2 * seq_sum).exp().mean() - 1.0).item(),
    }


# ----------------------------------------------------------------------------- trainer entry points


def _section(cfg) -> Any:
    return config_get(config_get(cfg, "algorithm"), "rollout_correction") if cfg is not None else None


def is_enabled(rc) -> bool:
    return rc is not None and (config_get(rc, "rollout_is") is not None or config_get(rc, "rollout_rs") is not None
                               or bool(config_get(rc, "bypass_mode", False)))


def apply_rollout_correction(batch, rc) -> dict[str, float]:
    """Decoupled mode, on the controller: add ``rollout_is_weights`` and apply rejection to ``response_mask``.

    Needs ``old_log_probs`` and ``rollout_log_probs`` in ``batch``; returns ``rollout_corr/*`` metrics."""
    if "rollout_log_probs" not in batch.batch.keys():
        raise ValueError("algorithm.rollout_correction needs the rollout engine's log-probs (rollout_log_probs) in "
                         "the batch; this rollout did not return them")
    old, roll = batch.batch["old_log_probs"].float(), batch.batch["rollout_log_probs"].float()
    mask = batch.batch["response_mask"]
    log_ratio = old - roll
    metrics: dict[str, float] = {}
    level = config_get(rc, "rollout_is")
    if level is not None:
        weights, m = compute_is_weights(log_ratio, mask.float(), level, config_get(rc, "rollout_is_threshold", 2.0),
                                        bool(config_get(rc, "rollout_is_batch_normalize", False)))
        batch.batch["rollout_is_weights"] = weights
        metrics.update(m)
    rs = config_get(rc, "rollout_rs")
    if rs is not None:
        new_mask, m = compute_rejection_mask(log_ratio, mask, rs, config_get(rc, "rollout_rs_threshold"))
        batch.batch["response_mask"] = new_mask
        metrics.update(m)
    metrics.update(compute_offpolicy_metrics(old, roll, mask.float()))
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def prepare_bypass_config(cfg) -> None:
    """Bypass mode: the actor's policy loss becomes ``bypass_mode`` and carries the rollout-correction section.

    Called once on the composed config before the workers start (they receive the actor config then)."""
    from omegaconf import OmegaConf, open_dict

    rc = _section(cfg)
    if rc is None or not config_get(rc, "bypass_mode", False):
        return
    actor = cfg.actor_rollout_ref.actor
    with open_dict(actor):
        actor.policy_loss.loss_mode = "bypass_mode"
        actor.policy_loss.rollout_correction = OmegaConf.create(OmegaConf.to_container(rc, resolve=True))


def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    config=None, rollout_is_weights=None):
    """Bypass mode's loss: ``old_log_prob`` is the rollout's. IS weights and rejection are computed here, per
    micro-batch, against the current policy. ``ppo_clip`` lets the clipped ratio pi/pi_rollout do the
    correction (weights only logged); ``reinforce`` applies the truncated weights to ``-A log pi``."""
    rc = config_get(config_get(config, "policy_loss"), "rollout_correction")
    if rc is None:
        raise ValueError("policy loss 'bypass_mode' needs actor.policy_loss.rollout_correction (set by "
                         "algorithm.rollout_correction.bypass_mode=true)")
    loss_type = config_get(rc, "loss_type", "ppo_clip")
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"algorithm.rollout_correction.loss_type={loss_type!r}; valid values are ppo_clip, reinforce")
    rollout_lp = old_log_prob
    mask = response_mask
    metrics: dict[str, float] = {}
    weights = None
    with torch.no_grad():
        log_ratio = log_prob.detach().float() - rollout_lp.float()
        level = config_get(rc, "rollout_is")
        if level is not None:
            weights, m = compute_is_weights(log_ratio, mask.float(), level, config_get(rc, "rollout_is_threshold", 2.0),
                                            bool(config_get(rc, "rollout_is_batch_normalize", False)))
            metrics.update(m)
        if config_get(rc, "rollout_rs") is not None:
            mask, m = compute_rejection_mask(log_ratio, mask, config_get(rc, "rollout_rs"),
                                             config_get(rc, "rollout_rs_threshold"))
            mask = mask.to(response_mask.dtype)
            metrics.update(m)
    if loss_type == "reinforce":
        loss, pg_metrics = compute_policy_loss_reinforce(rollout_lp, log_prob, advantages, mask, loss_agg_mode,
                                                         config, weights)
    else:
        loss, pg_metrics = compute_policy_loss_vanilla(rollout_lp, log_prob, advantages, mask, loss_agg_mode, config)
    out = dict(pg_metrics)
    out.update({f"rollout_corr/{k}": v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)})
    return loss, out
