"""Triton kernels of the Qwen3.5 decode step (one token per slot), for the hf engine's CUDA path.

A captured decode step is launch-bound at small batch and bandwidth-bound at large batch. The unfused step
spends most of its ~1,700 kernels on elementwise chains (each HF RMSNorm is seven kernels, the Gated DeltaNet
gates ten, the conv window eight); these kernels do each chain in one pass:

* :func:`add_rms_norm` - ``h = h + delta`` (rounded to the model dtype, as the unfused add) then Qwen3.5's
  zero-centred RMSNorm of ``h``; without ``delta``, the norm alone (also over strided rows: q/k norms);
* :func:`conv_step_` - the depthwise causal conv over the slot's cached window plus the new input, SiLU, and
  the window shifted in place;
* :func:`gdn_decode_step_` - one token of the gated delta rule updating the recurrent state in place, reading
  q/k/v straight from the conv output and, optionally, computing ``beta = sigmoid(b)`` and
  ``g = -exp(A_log) * softplus(a + dt_bias)`` from the raw projections;
* :func:`gated_rms_norm` - the Gated DeltaNet output norm ``(w * rmsnorm(x)) * silu(z)``.

The recurrent state dominates the traffic (a 0.8B-shaped Qwen3.5 holds 18 layers x 16 heads x 128 x 128 fp32
per sequence, read and written every token): each program of :func:`gdn_decode_step_` owns a K x 32 tile,
reads it once and writes it back. Every kernel computes in fp32 and rounds where the unfused torch code does;
``qwen3_5_runner`` keeps that torch code as the reference (CPU, and the GPU tests compare the two).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_step(q, k, v, g, beta, a_log, dt_bias, state, out, scale, stride_qk, stride_v,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     RAW_GATES: tl.constexpr):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)  # (batch, value head)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)  # grouped value heads: consecutive value heads share a key head
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + i_b * stride_qk + i_h * K + o_k).to(tl.float32)
    b_k = tl.load(k + i_b * stride_qk + i_h * K + o_k).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_v = tl.load(v + i_b * stride_v + i_hv * V + o_v).to(tl.float32)
    if RAW_GATES:  # g and beta from the raw a / b projections (rows of HV), as the unfused torch gates
        b_beta = tl.sigmoid(tl.load(beta + i_bh).to(tl.float32))
        x = tl.load(g + i_bh).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        b_g = -tl.exp(tl.load(a_log + i_hv).to(tl.float32)) * softplus
    else:
        b_g = tl.load(g + i_bh).to(tl.float32)
        b_beta = tl.load(beta + i_bh).to(tl.float32)
    p_h = state + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h).to(tl.float32) * tl.exp(b_g)
    b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
    b_h += b_k[:, None] * b_delta[None, :]
    tl.store(p_h, b_h.to(p_h.dtype.element_ty))
    b_o = tl.sum(b_h * b_q[:, None], 0)
    tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty))


def supports(k_dim: int, v_dim: int) -> bool:
    return k_dim & (k_dim - 1) == 0 and v_dim % 32 == 0 and k_dim <= 256


def gdn_decode_step_(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Output (B, 1, HV, V) of one token; ``state`` (contiguous, fp32 or bf16) is updated in place.
    q/k: (B, 1, H, K), v: (B, 1, HV, V), g/beta: (B, 1, HV), all contiguous (the runner's common step
    interface, shared with the fla and torch steps)."""
    b, _, h, dk = k.shape
    hv, dv = v.shape[2], v.shape[-1]
    out = torch.empty_like(v)
    _launch_step(q, k, v, g, beta, None, None, state, out, b, h, hv, dk, dv, h * dk, hv * dv)
    return out


def gdn_decode_fused_(mixed: torch.Tensor, n_k: int, n_v: int, d_k: int, d_v: int, a: torch.Tensor,
                      b_raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                      state: torch.Tensor) -> torch.Tensor:
    """One token from the conv output ``mixed`` (B, C) = [q | k | v] and the raw gate projections ``a`` /
    ``b_raw`` (B, HV): returns (B, HV, V) and updates ``state`` (B, HV, K, V) in place."""
    bsz = mixed.shape[0]
    out = torch.empty(bsz, n_v, d_v, dtype=mixed.dtype, device=mixed.device)
    qk = n_k * d_k
    q, k, v = mixed[:, :qk], mixed[:, qk:2 * qk], mixed[:, 2 * qk:]
    _launch_step(q, k, v, a, b_raw, a_log, dt_bias, state, out, bsz, n_k, n_v, d_k, d_v, mixed.stride(0),
                 mixed.stride(0))
    return out


def _launch_step(q, k, v, g, beta, a_log, dt_bias, state, out, bsz, h, hv, dk, dv, stride_qk, stride_v):
    bv = 32
    raw = a_log is not None
    _gdn_decode_step[(dv // bv, bsz * hv)](
        q, k, v, g, beta, a_log if raw else g, dt_bias if raw else g, state, out, dk**-0.5, stride_qk, stride_v,
        H=h, HV=hv, K=dk, V=dv, BV=bv, RAW_GATES=raw, num_warps=4)


@triton.jit
def _add_rms_norm(x, delta, w, x_out, y, n_cols, stride_x, eps, HAS_DELTA: tl.constexpr,
                  ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta + row * n_cols + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(x_out.dtype.element_ty)  # the unfused add's rounding
        tl.store(x_out + row * n_cols + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    wf = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        wf = 1.0 + wf
    tl.store(y + row * n_cols + cols, ((hf * inv) * wf).to(y.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                 zero_centred: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rmsnorm(x + delta)) over the last dim; without ``delta``: (x, rmsnorm(x)). ``x`` may have
    strided rows (its last dim contiguous); the outputs are contiguous with ``x``'s shape."""
    n = x.shape[-1]
    rows = x.numel() // n
    stride = _row_stride(x)
    if stride is None:
        x = x.contiguous()
        stride = n
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    out = torch.empty_like(y) if delta is not None else y
    _add_rms_norm[(rows,)](x, delta if delta is not None else x, weight, out, y, n, stride, eps,
                           HAS_DELTA=delta is not None, ZERO_CENTRED=zero_centred,
                           BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8)
    return (out.reshape(x.shape) if delta is not None else x), y.reshape(x.shape)


def _row_stride(x: torch.Tensor) -> Optional[int]:
    """The stride between consecutive rows when ``x`` is a (rows, last dim) grid with a contiguous last dim."""
    if x.stride(-1) != 1:
        return None
    dims = [i for i in range(x.dim() - 1) if x.shape[i] != 1]
    if not dims:
        return x.shape[-1]
    step = expected = x.stride(dims[-1])
    for i in reversed(dims):
        if x.stride(i) != expected:
            return None
        expected *= x.shape[i]
    return step


@triton.jit
def _conv_step(x, state, w, bias, out, C, stride_x, W1: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < C
    new = tl.load(x + row * stride_x + c, mask=mask, other=0.0)
    acc = new.to(tl.float32) * tl.load(w + c * (W1 + 1) + W1, mask=mask, other=0.0).to(tl.float32)
    base = state + row * W1 * C
    for i in tl.static_range(W1):
        s = tl.load(base + i * C + c, mask=mask, other=0.0)
        acc += s.to(tl.float32) * tl.load(w + c * (W1 + 1) + i, mask=mask, other=0.0).to(tl.float32)
        if i > 0:
            tl.store(base + (i - 1) * C + c, s, mask=mask)  # the window moves one token on
    tl.store(base + (W1 - 1) * C + c, new.to(state.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        acc += tl.load(bias + c, mask=mask, other=0.0).to(tl.float32)
    acc = acc * tl.sigmoid(acc)
    tl.store(out + row * C + c, acc.to(out.dtype.element_ty), mask=mask)


def conv_step_(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(depthwise conv over [state | x]) for x (B, C) and the window ``state`` (B, W - 1, C), which is
    shifted in place to end with x. ``weight``: (C, W). Returns (B, C) in x's dtype."""
    bsz, c = x.shape
    out = torch.empty(bsz, c, dtype=x.dtype, device=x.device)
    block = 256
    _conv_step[(bsz, triton.cdiv(c, block))](x, state, weight, bias if bias is not None else weight, out, c,
                                              x.stride(0), W1=state.shape[1], HAS_BIAS=bias is not None,
                                              BLOCK=block, num_warps=2)
    return out


@triton.jit
def _gated_rms_norm(x, z, w, y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x + row * n_cols + cols, mask=mask, other=0.0)
    hf = h.to(tl.float32)
    normed = (hf * tl.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)).to(h.dtype)
    wv = tl.load(w + cols, mask=mask, other=0.0)
    scaled = (wv.to(tl.float32) * normed.to(tl.float32)).to(h.dtype).to(tl.float32)  # w * x in x's dtype
    gate = tl.load(z + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * n_cols + cols, (scaled * (gate * tl.sigmoid(gate))).to(y.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's Gated DeltaNet output norm over the last dim of contiguous ``x`` and gate ``z``."""
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    _gated_rms_norm[(rows,)](x, z, weight, y, n, eps, BLOCK=triton.next_power_of_2(n), num_warps=1)
    return y


# ---------------------------------------------------------------------------------------------- decode attention
# One query token per slot over the slot's cache, reading only the keys it can see. The torch step multiplies
# the query by the slot's whole allocation (prompt + the longest response allowed), so at a 1k prompt with a 4k
# response limit it reads ~5x the live keys early in a rollout; here each program owns one (slot, kv head,
# chunk of CHUNK positions) and stops at the slot's position (split-K "flash decoding": chunks past it exit at
# once), and a second kernel merges the chunks' partial softmaxes. The grid depends only on the allocation, so
# a CUDA graph captured at one length stays valid as the slots grow.


@triton.jit
def _decode_attn_chunk(q, kc, vc, pos, part_out, part_lse, scale, stride_qb, stride_kb, stride_kh, stride_kl,
                       n_chunks, HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)  # kv head; its G query heads are consecutive
    i_c = tl.program_id(2)
    visible = tl.load(pos + i_b) + 1  # keys 0 .. pos (the step wrote its own key at pos)
    start = i_c * CHUNK
    if start < visible:  # a chunk past the slot's position writes nothing; the merge does not read it
        o_g = tl.arange(0, GP)
        o_d = tl.arange(0, D)
        g_live = o_g < G
        b_q = tl.load(q + i_b * stride_qb + (i_h * G + o_g[:, None]) * D + o_d[None, :], mask=g_live[:, None],
                      other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        base = i_b * stride_kb + i_h * stride_kh
        end = tl.minimum(start + CHUNK, visible)
        for off in tl.static_range(0, CHUNK, BLOCK):  # blocks past ``end`` load nothing (masked)
            o_l = start + off + tl.arange(0, BLOCK)
            live = o_l < end
            b_k = tl.load(kc + base + o_l[:, None] * stride_kl + o_d[None, :], mask=live[:, None], other=0.0)
            if IEEE:  # fp32 models: no TF32 rounding in the scores (the torch step's fp32 matmul)
                s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
            else:
                s = tl.dot(b_q, tl.trans(b_k))
            s = tl.where(live[None, :], s * scale, float("-inf"))  # (GP, BLOCK) fp32
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            b_v = tl.load(vc + base + o_l[:, None] * stride_kl + o_d[None, :], mask=live[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, b_v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(b_v.dtype), b_v)  # probabilities rounded to the cache dtype, as the torch step
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        row = (i_b * HQ + i_h * G + o_g) * n_chunks + i_c  # partials laid out (slot, query head, chunk)
        tl.store(part_out + row[:, None] * D + o_d[None, :], acc / l_i[:, None], mask=g_live[:, None])
        tl.store(part_lse + row, m_i + tl.log(l_i), mask=g_live)


@triton.jit
def _decode_attn_merge(pos, part_out, part_lse, out, n_chunks, HQ: tl.constexpr, D: tl.constexpr,
                       CHUNK: tl.constexpr, NCP: tl.constexpr):
    i_bq = tl.program_id(0).to(tl.int64)  # (slot, query head)
    live = tl.cdiv(tl.load(pos + i_bq // HQ) + 1, CHUNK)  # chunks the first kernel wrote
    o_c = tl.arange(0, NCP)
    lse = tl.load(part_lse + i_bq * n_chunks + o_c, mask=o_c < live, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # 0 for the unwritten chunks
    o_d = tl.arange(0, D)
    part = tl.load(part_out + (i_bq * n_chunks + o_c[:, None]) * D + o_d[None, :], mask=(o_c < live)[:, None],
                   other=0.0)
    acc = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out + i_bq * D + o_d, acc.to(out.dtype.element_ty))


def attention_supported(head_dim: int) -> bool:
    return head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     scale: float, chunk: Optional[int] = None) -> torch.Tensor:
    """Softmax attention of one query token per slot over keys ``0 .. pos[i]`` of its cache: q (B, Hq, D) with a
    contiguous last two dims, caches (B, Hkv, L, D) with a contiguous last dim (``SlotCache.kv`` views, same
    strides for keys and values), ``pos`` (B,) int. Grouped queries: query heads ``h * G .. h * G + G - 1`` read
    kv head ``h``. Returns (B, Hq * D) in q's dtype. ``chunk``: positions per program (default: 256, or more so
    that a long allocation has at most 32 chunks, the merge's register tile)."""
    b, hq, d = q.shape
    hkv, length = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(2) == 1 and q.stride(1) == d and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    g = hq // hkv
    chunk = chunk or max(256, triton.next_power_of_2(triton.cdiv(length, 32)))
    n_chunks = triton.cdiv(length, chunk)
    part_out = torch.empty(b, hq, n_chunks, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(b, hq, n_chunks, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hq * d, dtype=q.dtype, device=q.device)
    _decode_attn_chunk[(b, hkv, n_chunks)](
        q, k_cache, v_cache, pos, part_out, part_lse, scale, q.stride(0), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), n_chunks, HQ=hq, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK=64, CHUNK=chunk,
        IEEE=q.dtype == torch.float32, num_warps=4)
    _decode_attn_merge[(b * hq,)](pos, part_out, part_lse, out, n_chunks, HQ=hq, D=d, CHUNK=chunk,
                                  NCP=triton.next_power_of_2(n_chunks), num_warps=4)
    return out
