"""Greedy and temperature sampling over the whole vocabulary in few passes (the decode step's sampler).

Over a 248k vocabulary the sampler is bandwidth work: the textbook chain (fp32 copy, divide by T, log-sum-exp,
softmax, cumulative sum, compare, count) reads and writes the ``(B, V)`` logits about a dozen times. Here:

* CUDA with Triton: :mod:`.sample_kernel`, one program per row, reading the logits twice (an online max /
  sum-exp / arg-max pass, then a cumulative-mass pass that counts the entries below the draw's target);
* elsewhere: :func:`torch_fused_sample`, in-place fp32 ops on one working copy and a binary search for the
  draw instead of a compare-and-count pass.

Both draw by inverse CDF with the per-row uniform ``u`` (:func:`.sampling.counter_uniform`), so they pick the
same token as each other and as the unfused sampler except where float summation order moves the target across
a boundary: rare on a peaked distribution, a few % of draws over 248k near-flat probabilities (2.7 % of rows
for ``randn * 3`` logits at T=1 on an H200), each within fp32 rounding of the exact inverse CDF. Neither syncs
with the host or has data-dependent shapes, so the step stays capturable as a CUDA graph.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _kernel():
    """:func:`.sample_kernel.triton_sample`, or None where Triton is not importable."""
    try:
        from verl.workers.rollout.hf_engine.sample_kernel import triton_sample
    except ImportError:
        return None
    return triton_sample


@functools.lru_cache(maxsize=None)
def _warn_no_kernel() -> None:
    logger.warning("hf rollout: Triton is not importable, so the decode sampler runs its torch path on CUDA "
                   "(several passes over the logits instead of two)")


def fused_sample(logits: torch.Tensor, temperature: float, u: Optional[torch.Tensor],
                 suppress_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, log-probs under softmax(logits / temperature)) of logits (B, V); ``u`` (B,) uniforms in
    (0, 1), or None for greedy (arg-max, log-probs at T = 1). ``suppress_index``: ids never drawn."""
    if suppress_index is not None and not suppress_index.numel():
        suppress_index = None
    if logits.is_cuda:
        kernel = _kernel()
        if kernel is not None:
            return kernel(logits, temperature, u, suppress_index)
        _warn_no_kernel()
    return torch_fused_sample(logits, temperature, u, suppress_index)


def torch_fused_sample(logits: torch.Tensor, temperature: float, u: Optional[torch.Tensor],
                       suppress_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of :func:`fused_sample` (and the reference the Triton kernel is tested against)."""
    vocab = logits.shape[-1]
    if u is None:
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1)
        cand = x if suppress_index is None else x.index_fill(-1, suppress_index, float("-inf"))
        tokens = cand.argmax(-1)
        return tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - lse
    # One fp32 working copy, turned in place into unnormalised probabilities and then their running sum.
    x = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        x.div_(temperature)  # a division, as the trainer's logits / T, so the log-probs round alike
    peak = x.amax(-1, keepdim=True)
    x.sub_(peak).exp_()
    lse = peak.squeeze(-1) + x.sum(-1).log()
    if suppress_index is not None:
        x.index_fill_(-1, suppress_index, 0.0)  # drawn never, but counted in the log-sum-exp above
    cdf = x.cumsum_(-1)
    target = u.to(torch.float32) * cdf[:, -1]
    # First entry whose running mass reaches the target = number of entries below it (the unfused count).
    tokens = torch.searchsorted(cdf, target[:, None]).squeeze(-1).clamp_(max=vocab - 1)
    chosen = logits.gather(-1, tokens[:, None]).squeeze(-1).float()
    if temperature != 1.0:
        chosen = chosen / temperature
    return tokens, chosen - lse
