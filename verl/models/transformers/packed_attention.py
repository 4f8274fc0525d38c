"""Causal attention that never crosses packed-sequence boundaries, and the Qwen3.5 gated attention forward.

``varlen_causal_attention`` picks, for half-precision CUDA tensors, flash-attn's varlen kernel when the package
is installed, else PyTorch's own variable-length attention (``torch.nn.attention.varlen.varlen_attn``, a
flash kernel shipped with torch >= 2.10, so flash-attn is not needed for the fast path). Otherwise (CPU, fp32,
older torch) it lays the sequences out as right-padded rows and runs causal SDPA, which is exact for real
tokens (every padded key sits after every real query of its row, so the causal mask already hides it) but
pays for the padding. ``VERL_PACKED_ATTN_BACKEND`` = flash_attn | torch_varlen | sdpa forces one (benchmarks).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

from verl.models.transformers.gated_deltanet import batch_to_packed, packed_to_batch


@functools.lru_cache(maxsize=None)
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """(varlen_attn, its keyword names) from torch, or None on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def torch_varlen_causal(q, k, v, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal packed attention through ``torch.nn.attention.varlen.varlen_attn``, whose keywords changed
    between releases: causality is ``is_causal`` (2.10) or ``window_size=(-1, 0)`` (2.11+); ``scale`` and
    ``enable_gqa`` exist only in newer ones (else q is pre-scaled and k/v heads repeated)."""
    fn, names = _torch_varlen()
    kwargs = {}
    if "window_size" in names:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in names:
        kwargs["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


BACKEND_ENV = "VERL_PACKED_ATTN_BACKEND"


def forced_backend() -> Optional[str]:
    """The backend ``VERL_PACKED_ATTN_BACKEND`` forces, or None for ``auto``."""
    forced = os.environ.get(BACKEND_ENV, "auto").lower()
    if forced == "auto":
        return None
    if forced not in ("flash_attn", "torch_varlen", "sdpa"):
        raise ValueError(f"{BACKEND_ENV}={forced!r}: expected auto, flash_attn, torch_varlen or sdpa")
    return forced


def select_backend(fast: bool, dropout: float = 0.0) -> str:
    """flash_attn, torch_varlen or sdpa, for tensors that can take the fast kernels (``fast``: half precision
    on CUDA) or not. Also what :mod:`verl.models.kernels` reports at start-up, so the report is the choice."""
    forced = forced_backend()
    if forced is not None:
        return forced
    if fast and _flash_varlen() is not None:
        return "flash_attn"
    if fast and dropout == 0.0 and _torch_varlen() is not None:
        return "torch_varlen"
    return "sdpa"


def packed_attention_backend(q: torch.Tensor, dropout: float = 0.0) -> str:
    """Which kernel :func:`varlen_causal_attention` uses for ``q``: flash_attn, torch_varlen or sdpa."""
    fast = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    backend = select_backend(fast, dropout)
    if fast and backend == "sdpa" and forced_backend() is None:
        _warn_padded_fallback()
    return backend


@functools.lru_cache(maxsize=None)
def _warn_padded_fallback():
    logging.getLogger(__name__).warning(
        "packed attention on CUDA runs padded SDPA: neither flash-attn nor torch.nn.attention.varlen (torch >= "
        "2.10) is available, so every sequence is padded to the longest one")


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (T, Hkv, D) packed tokens; returns (T, Hq, D)."""
    backend = packed_attention_backend(q, dropout)
    if backend == "flash_attn":
        cu = cu_seqlens.to(torch.int32)
        return _flash_varlen()(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale,
                               causal=True)
    if backend == "torch_varlen":
        if dropout:
            raise ValueError("torch varlen attention has no dropout; use flash_attn or sdpa")
        return torch_varlen_causal(q, k, v, cu_seqlens, max_seqlen, scale)
    qb, index = packed_to_batch(q, cu_seqlens, max_seqlen)
    kb, _ = packed_to_batch(k, cu_seqlens, max_seqlen)
    vb, _ = packed_to_batch(v, cu_seqlens, max_seqlen)
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2),
        kb.transpose(1, 2),
        vb.transpose(1, 2),
        is_causal=True,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=qb.shape[2] != kb.shape[2],
    )
    return batch_to_packed(out.transpose(1, 2), index)


def _rotary_helper(module):
    # The rotary helper is a plain function of the module's own modeling file (dense or MoE); reuse it.
    import importlib

    from verl.models.transformers.monkey_patch import modeling_module_name

    return importlib.import_module(modeling_module_name(module)).apply_rotary_pos_emb


def gated_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    packed=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Qwen3.5 full attention (q/k RMSNorm, partial rotary, sigmoid output gate) over packed tokens.

    hidden_states: (B, T, H). With ``packed`` (B == 1) attention is block-diagonal causal over its
    sequences; without it each row is one sequence. Returns (output, None) like the HF module.
    """
    if kwargs.get("past_key_values") is not None:  # cached decoding: stock path with its KV cache and mask
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    from verl.models.transformers import qwen3_5 as q35

    b, t, _ = hidden_states.shape
    hd = self.head_dim
    q_and_gate = self.q_proj(hidden_states).view(b, t, -1, 2 * hd)
    q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:]
    q = self.q_norm(q)
    k = self.k_norm(self.k_proj(hidden_states).view(b, t, -1, hd))
    v = self.v_proj(hidden_states).view(b, t, -1, hd)
    cos, sin = position_embeddings
    # unsqueeze_dim=2 because q/k are (B, T, heads, D) here.
    q, k = _rotary_helper(self)(q, k, cos, sin, unsqueeze_dim=2)

    sp = q35.current_sp_group(packed)
    if sp is not None:
        world = torch.distributed.get_world_size(sp)
        if k.shape[2] % world != 0:
            # Too few KV heads to split: give every query head its own copy first.
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (q35.seq_to_heads(z, sp) for z in (q, k, v))
    dropout = self.attention_dropout if self.training else 0.0
    if packed is not None:
        out = varlen_causal_attention(q[0], k[0], v[0], packed.cu_seqlens, packed.max_seqlen, self.scaling, dropout)
        out = out.unsqueeze(0)
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=dropout,
            scale=self.scaling,
            enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)
    if sp is not None:
        out = q35.heads_to_seq(out, sp)
    out = out.reshape(b, t, -1) * torch.sigmoid(gate.reshape(b, t, -1))
    return self.o_proj(out), None
