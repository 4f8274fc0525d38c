"""Packed rows (several sequences in one ``(1, T)`` row) and causal attention that never crosses their boundaries.

Shared by every architecture's packed forward: :class:`PackedSeqInfo` (the boundaries the layers see) and the
helpers between a packed row and padded rows.

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
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class PackedSeqInfo:
    """Boundaries of the packed row that the layers see.

    cu_seqlens covers the whole (global, SP-gathered) row; ``sp_group`` is set when the row is sharded over a
    Ulysses group, in which case the layers all-to-all to full sequences before using cu_seqlens.
    """

    cu_seqlens: torch.Tensor  # int32, (num_seqs + 1,)
    max_seqlen: int
    sp_group: Optional[dist.ProcessGroup] = None


def current_sp_group(packed: Optional[PackedSeqInfo]):
    return None if packed is None else packed.sp_group


def cu_seqlens_from_starts(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """starts: (T,) bool marking the first token of each sequence (index 0 is always a start)."""
    starts = starts.clone()
    starts[0] = True
    idx = torch.nonzero(starts, as_tuple=False).flatten()
    total = torch.tensor([starts.numel()], device=starts.device, dtype=idx.dtype)
    cu = torch.cat([idx, total]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max().item())
    return cu, max_len


def seq_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(T,) long tensor: index of the sequence each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)


def packed_to_batch(x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter packed ``(T, ...)`` rows into a right-padded ``(N, max_len, ...)`` batch.

    Returns the batch and the flat index (into N * max_len) of every packed token, used to gather back.
    Right padding is harmless for causal operators: padded slots sit after every real token of their row.
    """
    total = x.shape[0]
    n = cu_seqlens.numel() - 1
    seq = seq_ids_from_cu_seqlens(cu_seqlens, total)
    offset_in_seq = torch.arange(total, device=x.device) - cu_seqlens.long()[seq]
    flat_index = seq * max_len + offset_in_seq
    out = x.new_zeros((n * max_len, *x.shape[1:]))
    out = out.index_copy(0, flat_index, x)
    return out.view(n, max_len, *x.shape[1:]), flat_index


def batch_to_packed(x: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:]).index_select(0, flat_index)


# ----------------------------------------------------------------------------------------------------------------
# Depthwise causal conv
# ----------------------------------------------------------------------------------------------------------------


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
