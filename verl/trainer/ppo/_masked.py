"""Small masked-reduction helpers used by the PPO algorithm modules.

These are private on purpose: ``verl.utils.torch_functional`` is the public
home for the same helpers, and the two are expected to be unified later.  Keeping
a private copy here lets ``core_algos`` stay importable on its own.
"""

from __future__ import annotations

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "clip_by_value",
    "entropy_from_logits",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero.

    Entries outside the mask are zeroed *before* multiplying, so a NaN/inf in a
    padded position cannot leak into the result (NaN * 0 is still NaN).
    """
    keep = mask.bool()
    cleaned = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    weighted = cleaned * mask.to(values.dtype)
    if axis is None:
        return weighted.sum()
    return weighted.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Mean over masked entries; a tiny epsilon keeps an empty mask finite (result 0)."""
    total = masked_sum(values, mask, axis)
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return total / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked entries (Bessel-corrected when ``unbiased``)."""
    centre = masked_mean(values, mask)
    var = masked_mean((values - centre) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element.")
        if n == 1:
            # n / (n - 1) would divide by zero; a bigger mini-batch avoids this.
            raise ValueError("masked_var: the mask selects a single element; unbiased variance is undefined.")
        var = var * (n / (n - 1))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise ``values`` with statistics taken over the masked entries only."""
    centre = masked_mean(values, mask)
    var = masked_var(values, mask)
    out = (values - centre) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + centre
    return out


def clip_by_value(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp with tensor-valued bounds."""
    return torch.maximum(torch.minimum(x, high), low)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) along the last dim: logsumexp(z) - E_p[z]."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
