"""One-token gated delta rule for a batch of slots, as a Triton kernel that updates the state in place.

Decoding is bound by the recurrent state's memory traffic (a 0.8B-shaped Qwen3.5 holds 18 layers x 16 heads x
128 x 128 fp32 per sequence, read and written every token). fla's fused recurrent kernel is written for long
sequences (a 128 x 8 state tile per program, one warp), which leaves most of the bandwidth unused at T = 1;
here each program owns a wider K x BV tile with several warps, reads it once, applies decay, delta update and
readout, and writes it back. Same math and layouts as ``qwen3_5_runner.torch_recurrent_step_`` (the reference
it is tested against on GPU): q/k (B, 1, H, K), v (B, 1, HV, V), g/beta (B, 1, HV), state (B, HV, K, V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_step(q, k, v, g, beta, state, out, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     V: tl.constexpr, BV: tl.constexpr):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)  # (batch, value head)
    i_b = i_bh // HV
    i_h = (i_bh % HV) // (HV // H)  # grouped value heads: consecutive value heads share a key head
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q = tl.load(q + (i_b * H + i_h) * K + o_k).to(tl.float32)
    b_k = tl.load(k + (i_b * H + i_h) * K + o_k).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_v = tl.load(v + i_bh * V + o_v).to(tl.float32)
    b_decay = tl.exp(tl.load(g + i_bh).to(tl.float32))
    b_beta = tl.load(beta + i_bh).to(tl.float32)
    p_h = state + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h).to(tl.float32) * b_decay
    b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
    b_h += b_k[:, None] * b_delta[None, :]
    tl.store(p_h, b_h.to(p_h.dtype.element_ty))
    b_o = tl.sum(b_h * b_q[:, None], 0)
    tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty))


def supports(k_dim: int, v_dim: int) -> bool:
    return k_dim & (k_dim - 1) == 0 and v_dim % 32 == 0 and k_dim <= 256


def gdn_decode_step_(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Output (B, 1, HV, V) of one token; ``state`` (contiguous, fp32 or bf16) is updated in place."""
    b, _, h, dk = k.shape
    hv, dv = v.shape[2], v.shape[-1]
    bv = 32
    out = torch.empty_like(v)
    _gdn_decode_step[(dv // bv, b * hv)](q, k, v, g, beta, state, out, dk**-0.5, H=h, HV=hv, K=dk, V=dv, BV=bv,
                                         num_warps=4)
    return out
