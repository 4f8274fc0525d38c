"""Triton (CUDA) backend of :func:`verl.utils.kernel.linear_logprob.linear_log_prob_entropy`.

Imported lazily: this module needs ``triton`` at import time; ``linear_log_prob_entropy``
checks for it first and raises an ImportError naming the ``gpu`` extra.

Design
------
Forward (fully Triton, one launch): the ``(N, V)`` logits are split into token blocks
(``BLOCK_M``) x vocab splits (``S``). A program owns one token block and one contiguous vocab
range; it walks that range in ``BLOCK_N`` tiles, computing each ``BLOCK_M x BLOCK_N`` logits tile
with ``tl.dot`` (fp32 accumulator, K loop over hidden) and folding it into per-row online
statistics: running max ``m``, ``s = sum exp(z - m)``, ``t = sum exp(z - m) * (z - m)`` and the
label logit. When the max moves to ``m'``, ``s <- a s`` and ``t <- a (t + s (m - m'))`` with
``a = exp(m - m')``. Keeping ``t`` relative to the max gives ``entropy = log s - t / s`` without
cancelling two large numbers (``lse - sum p z``). The ``S`` partials per token are merged in
torch (``O(N * S)`` work) by the same rescaling to the common max ``M``::

    s_i' = s_i e^{m_i - M},   t_i' = e^{m_i - M} (t_i + s_i (m_i - M))
    lse = M + log sum s_i',   entropy = log sum s_i' - sum t_i' / sum s_i',   log_prob = z[label] - lse

Programs are ordered in groups of ``GROUP_M`` token blocks x all splits, so the hidden rows of
the programs in flight stay in L2 while each weight tile is read by ``GROUP_M`` programs.

Backward (Triton + cuBLAS): tokens are processed in chunks; for each chunk one Triton kernel
recomputes the logits tiles and writes ``dL/dlogits`` in the input dtype (a ``(chunk, V)``
buffer, never ``(N, V)``), using the saved ``lse`` and entropy::

    dz = g_lp * onehot(label) - p * (g_lp + g_ent * (z - lse + H)),   dlogits = dz / T

then cuBLAS does ``dhidden[chunk] = dlogits @ W`` and ``dW += dlogits.T @ hidden[chunk]`` into an
fp32 accumulator (``addmm`` with ``out_dtype=float32`` when available).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verl.utils.kernel.matmul import accumulate_mm

__all__ = ["TritonLinearLogProbEntropy", "triton_linear_log_prob_entropy"]

# Tile shapes per compute dtype (bf16/fp16 use tensor cores; fp32 uses exact IEEE dots).
_FWD_CFG = {
    "half": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=32, num_warps=8, num_stages=3),
    "fp32": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=32, num_warps=4, num_stages=2),
}
_BWD_CFG = {
    "half": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "fp32": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2),
}
# Aim for this many programs per SM in the forward so the last wave is a small fraction.
_FWD_PROGRAMS_PER_SM = 8


@triton.jit
def _logits_tile(h_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, H, s_hm, s_hk, s_wv, s_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``hidden[offs_m] @ weight[offs_n].T`` tile (BLOCK_M, BLOCK_N)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + offs_m[:, None] * s_hm + offs_k[None, :] * s_hk
    b_ptrs = w_ptr + offs_n[None, :] * s_wv + offs_k[:, None] * s_wk
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_hk
        b_ptrs += BLOCK_K * s_wk
    return acc


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, lab_ptr, pm_ptr, ps_ptr, pt_ptr, pl_ptr,
                N, V, H, S, s_hm, s_hk, s_wv, s_wk, inv_t,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(N, BLOCK_M)
    # Group GROUP_M token blocks x all S splits together (see module docstring).
    per_group = GROUP_M * S
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(m_blocks - first_m, GROUP_M)
    r = pid % per_group
    pid_m = first_m + r % gsize
    pid_s = r // gsize

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < N
    labels = tl.load(lab_ptr + offs_m, mask=mask_m, other=-1)

    tiles_per_split = tl.cdiv(tl.cdiv(V, BLOCK_N), S)
    v_start = pid_s * tiles_per_split * BLOCK_N
    v_end = tl.minimum(v_start + tiles_per_split * BLOCK_N, V)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_i = tl.zeros((BLOCK_M,), tl.float32)
    t_i = tl.zeros((BLOCK_M,), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    for v0 in range(v_start, v_end, BLOCK_N):
        offs_n = (v0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_n = offs_n < v_end
        z = _logits_tile(h_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, H, s_hm, s_hk, s_wv, s_wk,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION) * inv_t
        z_valid = tl.where(mask_n[None, :], z, 0.0)
        z = tl.where(mask_n[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        alpha = tl.exp(m_i - m_new)
        zc = z - m_new[:, None]  # -inf on masked columns
        e = tl.exp(zc)
        # First tile: s_i == 0 and m_i == -inf; guard the 0 * inf.
        shift = tl.where(s_i > 0, s_i * (m_i - m_new), 0.0)
        t_i = alpha * (t_i + shift) + tl.sum(tl.where(mask_n[None, :], e * zc, 0.0), axis=1)
        s_i = s_i * alpha + tl.sum(e, axis=1)
        m_i = m_new
        l_i += tl.sum(tl.where(offs_n[None, :] == labels[:, None], z_valid, 0.0), axis=1)

    out = pid_s * N + offs_m
    tl.store(pm_ptr + out, m_i, mask=mask_m)
    tl.store(ps_ptr + out, s_i, mask=mask_m)
    tl.store(pt_ptr + out, t_i, mask=mask_m)
    tl.store(pl_ptr + out, l_i, mask=mask_m)


@triton.jit
def _bwd_dlogits_kernel(h_ptr, w_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dz_ptr,
                        N, V, H, s_hm, s_hk, s_wv, s_wk, s_dm, s_dv, inv_t,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(N, BLOCK_M)
    n_blocks = tl.cdiv(V, BLOCK_N)
    # Standard grouped ordering for L2 reuse of weight tiles.
    per_group = GROUP_M * n_blocks
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % gsize
    pid_n = (pid % per_group) // gsize

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < N
    mask_n = offs_n < V
    z = _logits_tile(h_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, H, s_hm, s_hk, s_wv, s_wk,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION) * inv_t

    labels = tl.load(lab_ptr + offs_m, mask=mask_m, other=-1)
    lse = tl.load(lse_ptr + offs_m, mask=mask_m, other=0.0)
    ent = tl.load(ent_ptr + offs_m, mask=mask_m, other=0.0)
    g_lp = tl.load(glp_ptr + offs_m, mask=mask_m, other=0.0)
    g_ent = tl.load(gent_ptr + offs_m, mask=mask_m, other=0.0)

    logp = z - lse[:, None]
    p = tl.exp(logp)
    d = -p * (g_lp[:, None] + g_ent[:, None] * (logp + ent[:, None]))
    d = tl.where(offs_n[None, :] == labels[:, None], d + g_lp[:, None], d) * inv_t
    ptrs = dz_ptr + offs_m[:, None] * s_dm + offs_n[None, :] * s_dv
    tl.store(ptrs, d.to(dz_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _cfg(table, dtype):
    cfg = dict(table["fp32" if dtype == torch.float32 else "half"])
    # fp32 inputs: exact IEEE dots (tf32 would cost ~1e-3 relative error); half: default.
    cfg["PRECISION"] = "ieee" if dtype == torch.float32 else None
    return cfg


def _num_splits(n_tok: int, vocab: int, block_m: int, block_n: int, device) -> int:
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    m_blocks = triton.cdiv(n_tok, block_m)
    want = triton.cdiv(_FWD_PROGRAMS_PER_SM * n_sm, m_blocks)
    return max(1, min(want, triton.cdiv(vocab, block_n)))


def _forward(hidden, weight, labels, inv_t):
    n_tok, h_dim = hidden.shape
    vocab = weight.shape[0]
    cfg = _cfg(_FWD_CFG, hidden.dtype)
    n_split = _num_splits(n_tok, vocab, cfg["BLOCK_M"], cfg["BLOCK_N"], hidden.device)
    parts = torch.empty((4, n_split, n_tok), dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(n_tok, cfg["BLOCK_M"]) * n_split,)
    _fwd_kernel[grid](
        hidden, weight, labels, parts[0], parts[1], parts[2], parts[3],
        n_tok, vocab, h_dim, n_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), inv_t,
        **cfg,
    )
    pm, ps, pt, pl = parts
    big_m = pm.max(dim=0).values
    scale = torch.exp(pm - big_m)  # empty splits have m=-inf -> scale 0
    shift = torch.where(ps > 0, ps * (pm - big_m), torch.zeros_like(ps))
    s_tot = (ps * scale).sum(0)
    t_tot = (scale * (pt + shift)).sum(0)
    log_s = torch.log(s_tot)
    lse = big_m + log_s
    entropy = log_s - t_tot / s_tot
    log_probs = pl.sum(0) - lse
    return log_probs, entropy, lse


def _dlogits(h_c, weight, lab_c, lse_c, ent_c, glp_c, gent_c, inv_t):
    n_c, h_dim = h_c.shape
    vocab = weight.shape[0]
    cfg = _cfg(_BWD_CFG, h_c.dtype)
    dz = torch.empty((n_c, vocab), dtype=h_c.dtype, device=h_c.device)
    grid = (triton.cdiv(n_c, cfg["BLOCK_M"]) * triton.cdiv(vocab, cfg["BLOCK_N"]),)
    _bwd_dlogits_kernel[grid](
        h_c, weight, lab_c, lse_c, ent_c, glp_c, gent_c, dz,
        n_c, vocab, h_dim,
        h_c.stride(0), h_c.stride(1), weight.stride(0), weight.stride(1), dz.stride(0), dz.stride(1), inv_t,
        **cfg,
    )
    return dz


class TritonLinearLogProbEntropy(torch.autograd.Function):
    """Triton forward, Triton-dlogits + cuBLAS backward (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size):
        if not hidden.is_cuda:
            raise ValueError("backend='triton' needs CUDA tensors")
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        labels = labels.contiguous()
        inv_t = 1.0 / float(temperature)
        log_probs, entropy, lse = _forward(hidden, weight, labels, inv_t)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.inv_t = inv_t
        # dlogits is stored in the input dtype: keep its bytes at the torch backend's fp32 budget.
        ctx.chunk_size = max(1, chunk_size * 4 // hidden.element_size())
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None
        n_tok = hidden.shape[0]
        zeros = torch.zeros(n_tok, dtype=torch.float32, device=hidden.device)
        g_lp = zeros if g_lp is None else g_lp.float().contiguous()
        g_ent = zeros if g_ent is None else g_ent.float().contiguous()
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        step = ctx.chunk_size
        for s in range(0, n_tok, step):
            e = min(s + step, n_tok)
            h_c = hidden[s:e]
            dz = _dlogits(h_c, weight, labels[s:e], lse[s:e], entropy[s:e], g_lp[s:e], g_ent[s:e], ctx.inv_t)
            if need_h:
                torch.mm(dz, weight, out=grad_h[s:e])
            if need_w:
                accumulate_mm(grad_w, dz.t(), h_c)
            del dz
        if need_w and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def triton_linear_log_prob_entropy(hidden, weight, labels, temperature: float = 1.0, chunk_size: int = 1024):
    """``(log_probs, entropy)`` for flat ``hidden (N, H)``, ``weight (V, H)``, ``labels (N,)``."""
    return TritonLinearLogProbEntropy.apply(hidden, weight, labels.long(), float(temperature), int(chunk_size))
