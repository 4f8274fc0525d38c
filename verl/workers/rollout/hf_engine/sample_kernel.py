"""Triton kernel of the fused decode sampler (see :mod:`.fused_sampler`): one program per row of the logits.

Pass 1 reads the row once and keeps, per lane, an online maximum, the sum of exp over every entry (the
log-sum-exp the log-prob needs), the sum over the drawable entries (suppressed ids left out) and the first
arg-max of the drawable entries. Greedy stops there. Sampling reads the row a second time: with the row maximum
fixed, it accumulates the drawable mass block by block (``tl.cumsum`` inside a block plus the mass of the
blocks before) and counts the entries whose running mass is still below ``u * drawable mass``; that count is
the drawn index, as in the torch path. Because the pass-2 sum runs in another order than pass 1's total, the
count is capped at the last entry with non-zero mass, so a rounding excess can never draw a zero-mass token.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _sample_rows(logits, stride_row, u, sup, tokens, log_probs, V, temperature,
                 N_SUP: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_row
    lanes = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m_v = tl.full([BLOCK], neg_inf, tl.float32)
    s_all = tl.zeros([BLOCK], tl.float32)
    s_cand = tl.zeros([BLOCK], tl.float32)
    best_v = tl.full([BLOCK], neg_inf, tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lanes
        valid = offs < V
        x = tl.load(base + offs, mask=valid, other=neg_inf).to(tl.float32) / temperature
        cand = valid
        for j in tl.static_range(N_SUP):
            cand = cand & (offs != tl.load(sup + j).to(tl.int32))
        new_m = tl.maximum(m_v, x)
        alpha = tl.where(new_m > neg_inf, tl.exp(m_v - new_m), 0.0)
        e = tl.where(x > neg_inf, tl.exp(x - new_m), 0.0)
        s_all = s_all * alpha + e
        s_cand = s_cand * alpha + tl.where(cand, e, 0.0)
        m_v = new_m
        xc = tl.where(cand, x, neg_inf)
        better = xc > best_v  # strict: a lane keeps its first maximum (later blocks hold larger indices)
        best_v = tl.where(better, xc, best_v)
        best_i = tl.where(better, offs, best_i)
    m = tl.max(m_v, 0)
    rescale = tl.where(m_v > neg_inf, tl.exp(m_v - m), 0.0)
    lse = m + tl.log(tl.sum(s_all * rescale, 0))
    if GREEDY:
        top = tl.max(best_v, 0)
        pick = tl.min(tl.where(best_v == top, best_i, V), 0)
    else:
        target = tl.load(u + row).to(tl.float32) * tl.sum(s_cand * rescale, 0)
        running = tl.zeros([1], tl.float32)
        below = tl.zeros([BLOCK], tl.int32)
        last = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            valid = offs < V
            x = tl.load(base + offs, mask=valid, other=neg_inf).to(tl.float32) / temperature
            cand = valid & (x > neg_inf)
            for j in tl.static_range(N_SUP):
                cand = cand & (offs != tl.load(sup + j).to(tl.int32))
            p = tl.where(cand, tl.exp(x - m), 0.0)
            cdf = tl.cumsum(p, 0) + running
            below += (valid & (cdf < target)).to(tl.int32)
            last = tl.maximum(last, tl.where(p > 0.0, offs, -1))
            running += tl.sum(p, 0)
        pick = tl.maximum(tl.minimum(tl.sum(below, 0), tl.max(last, 0)), 0)
    chosen = tl.load(base + pick).to(tl.float32) / temperature
    tl.store(tokens + row, pick.to(tl.int64))
    tl.store(log_probs + row, chosen - lse)


def triton_sample(logits: torch.Tensor, temperature: float, u: Optional[torch.Tensor],
                  suppress_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`.fused_sampler.torch_fused_sample`, on CUDA."""
    b, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    log_probs = torch.empty(b, dtype=torch.float32, device=logits.device)
    n_sup = 0 if suppress_index is None else int(suppress_index.numel())  # a shape, not a device read
    greedy = u is None
    _sample_rows[(b,)](
        logits, logits.stride(0), log_probs if greedy else u.to(torch.float32).contiguous(),
        tokens if suppress_index is None else suppress_index, tokens, log_probs, vocab,
        1.0 if greedy else float(temperature), N_SUP=n_sup, GREEDY=greedy, BLOCK=_BLOCK, num_warps=8,
    )
    return tokens, log_probs
