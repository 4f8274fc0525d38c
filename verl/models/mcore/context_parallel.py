"""Context parallelism (CP) for packed THD rows, in plain torch + ``torch.distributed`` (no megatron import, so the
math is tested on CPU with gloo).

Layout. Every sequence of a packed row is padded to a multiple of ``2 * cp`` and cut into ``2 * cp`` equal
chunks; CP rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` of every sequence (the usual load balance for
causal attention: an early and a late chunk). A rank's local row is, sequence after sequence, its early chunk then
its late chunk, so the local row has ``total / cp`` tokens and its local boundaries are the global ones divided by
``cp``. :class:`CPShard` owns the index arithmetic; the model receives the *global* (padded) ``cu_seqlens`` and
the local tokens, as megatron-core does for THD context parallelism.

Collectives (each an autograd function, so backward is exact):

* :func:`gather_to_full` - local per-token values -> the full row in sequence order, for a consumer that is
  replicated on every CP rank (the loss): backward keeps the rank's own slice of the (identical) gradient.
* :func:`all_gather_cp` - a tensor from every rank, for consumers that differ per rank (keys and values, the
  conv halo): backward sums the gradients over the ranks (reduce-scatter).
* :func:`cp_causal_attention` - local queries against the all-gathered keys/values of their sequences, causal
  with the chunk's offset. Cost: one all-gather of K and V per attention layer (memory of the full sequence's
  K/V on every rank, the same as CP=1 for K/V; the queries, scores and everything else are split).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["CPShard", "cp_pad_length", "gather_to_full", "all_gather_cp", "cp_causal_attention", "chunk_owner"]


def cp_pad_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of ``2 * cp`` (the unit a sequence is cut into under CP)."""
    unit = 2 * cp
    return -(-int(length) // unit) * unit


def chunk_owner(chunk: int, cp: int) -> tuple[int, int]:
    """(rank, slot) holding chunk ``chunk`` of every sequence: slot 0 is the rank's early chunk, 1 its late one."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


@dataclass(frozen=True)
class CPShard:
    """Where each token of a packed row lives under context parallelism (see the module docstring).

    ``bounds`` are the global (padded) ``cu_seqlens``: every sequence length is a multiple of ``2 * cp``."""

    cp: int
    rank: int
    bounds: tuple
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor | Sequence[int], cp: int, rank: int) -> "CPShard":
        bounds = tuple(int(b) for b in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens))
        device = cu_seqlens.device if torch.is_tensor(cu_seqlens) else torch.device("cpu")
        if not 0 <= rank < cp:
            raise ValueError(f"context-parallel rank {rank} outside [0, {cp})")
        bad = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if (b - a) % (2 * cp) or b <= a]
        if bad:
            raise ValueError(f"context parallelism over {cp} ranks needs every packed sequence to be a non-empty "
                             f"multiple of {2 * cp} tokens (pad them: packing.pack_thd(cp=...)); got lengths {bad}")
        return cls(cp, rank, bounds, device)

    # -------------------------------------------------------------- sizes
    @property
    def num_seqs(self) -> int:
        return len(self.bounds) - 1

    @functools.cached_property
    def chunk_lens(self) -> tuple:
        """m_i: the chunk length of every sequence (its length / (2 cp))."""
        return tuple((b - a) // (2 * self.cp) for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def local_len(self) -> int:
        return self.total // self.cp

    @functools.cached_property
    def local_bounds(self) -> tuple:
        """Boundaries of the sequences in the local row (the global ones / cp)."""
        return tuple(b // self.cp for b in self.bounds)

    def _t(self, values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.long).to(self.device)

    # -------------------------------------------------------------- indices (into the full or the local row)
    def chunk_start(self, seq: int, chunk: int) -> int:
        """Position in the full row of the first token of ``chunk`` of sequence ``seq``."""
        return self.bounds[seq] + chunk * self.chunk_lens[seq]

    def _local_positions(self, rank: int) -> list[int]:
        out: list[int] = []
        for i, m in enumerate(self.chunk_lens):
            for chunk in (rank, 2 * self.cp - 1 - rank):
                s = self.chunk_start(i, chunk)
                out.extend(range(s, s + m))
        return out

    def local_index(self, rank: Optional[int] = None) -> torch.Tensor:
        """Full-row positions of ``rank``'s local tokens, in local order."""
        rank = self.rank if rank is None else rank
        return self._index_cache[rank]

    @functools.cached_property
    def _index_cache(self) -> tuple:
        return tuple(self._t(self._local_positions(r)) for r in range(self.cp))

    @functools.cached_property
    def gather_order(self) -> torch.Tensor:
        """For every full-row position, its row in the rank-major concatenation of all local rows (what an
        all-gather returns): ``full = gathered[gather_order]``."""
        inverse = torch.empty(self.total, dtype=torch.long)
        inverse[torch.cat([t.cpu() for t in self._index_cache])] = torch.arange(self.total)
        return inverse.to(self.device)

    def slot_index(self, slot: int) -> torch.Tensor:
        """Local positions of this rank's ``slot`` chunk (0 early, 1 late) of every sequence, sequence after
        sequence (a packed row of chunks whose boundaries are :meth:`chunk_cu_seqlens`)."""
        return self._slot_cache[slot]

    @functools.cached_property
    def _slot_cache(self) -> tuple:
        out = ([], [])
        for lo, m in zip(self.local_bounds[:-1], self.chunk_lens):
            out[0].extend(range(lo, lo + m))
            out[1].extend(range(lo + m, lo + 2 * m))
        return self._t(out[0]), self._t(out[1])

    @functools.cached_property
    def chunk_cu_seqlens(self) -> torch.Tensor:
        """int32 boundaries of the row of one chunk per sequence (lengths m_i)."""
        cu = [0]
        for m in self.chunk_lens:
            cu.append(cu[-1] + m)
        return torch.tensor(cu, dtype=torch.int32).to(self.device)

    def shard(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's tokens of a full-row tensor (``dim`` is the token dimension)."""
        return x.index_select(dim, self.local_index())


# ------------------------------------------------------------------------------------------------------------------
# Collectives with exact backward
# ------------------------------------------------------------------------------------------------------------------


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _all_gather_cat(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_sum(grad: torch.Tensor, group) -> torch.Tensor:
    """Rank-major ``grad`` [cp * n, ...] summed over the ranks -> this rank's block [n, ...]."""
    grad = grad.contiguous()
    size, rank = _group_size(group), dist.get_rank(group)
    n = grad.shape[0] // size
    if dist.get_backend(group) == "nccl":
        out = grad.new_empty((n, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out
    # gloo has no reduce-scatter: the all-reduce gives every block's sum, of which this rank keeps its own
    dist.all_reduce(grad, group=group)
    return grad[rank * n:(rank + 1) * n].clone()


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``x`` (rank order, dim 0); each rank's consumer differs, so grads are summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_cat(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sum(grad, ctx.group), None


def all_gather_cp(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` on every rank -> ``[cp * n, ...]`` (rank-major); backward sums over the ranks."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllGather.apply(x, group)
    return _all_gather_cat(x, group)


class _GatherFull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard: CPShard, group, dim: int):
        ctx.shard, ctx.dim = shard, dim
        moved = x.movedim(dim, 0)
        full = _all_gather_cat(moved, group).index_select(0, shard.gather_order)
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        # The consumer (the loss) is the same on every CP rank, so every rank holds the whole, identical gradient:
        # this rank's share is its own positions, with no communication.
        return grad.index_select(ctx.dim, ctx.shard.local_index()), None, None, None


def gather_to_full(x: torch.Tensor, shard: CPShard, group, dim: int = -1) -> torch.Tensor:
    """Local per-token values (token dimension ``dim``) -> the full row in sequence order on every CP rank, for a
    consumer computed identically on all of them (log-probs, entropy, values -> the loss)."""
    dim = dim % x.dim()
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherFull.apply(x, shard, group, dim)
    moved = x.movedim(dim, 0)
    return _all_gather_cat(moved, group).index_select(0, shard.gather_order).movedim(0, dim)


# ------------------------------------------------------------------------------------------------------------------
# Causal attention of local queries against all-gathered keys/values
# ------------------------------------------------------------------------------------------------------------------


def _lower_right_causal(q, k, v, scale):
    """q [1, H, m, D] at the end of k/v [1, H, n, D] (n >= m): query j sees keys <= n - m + j."""
    m, n = q.shape[2], k.shape[2]
    if m == n:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(m, n), scale=scale)


def cp_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: CPShard, group,
                        scale: float) -> torch.Tensor:
    """Packed causal attention under CP: q [T_local, Hq, D], k/v [T_local, Hkv, D] -> [T_local, Hq, D].

    K and V are all-gathered (one collective for both) and put in full-row order; every local chunk ``c`` of a
    sequence attends to that sequence's keys ``[0, (c + 1) m)`` with the causal diagonal shifted by ``c m``.
    Grouped KV heads are repeated for the kernel (the lower-right causal kernels take equal head counts)."""
    d_k = k.shape[-1]
    kv = torch.cat([k, v], dim=-1)
    full = all_gather_cp(kv, group).index_select(0, shard.gather_order)
    kf, vf = full[..., :d_k], full[..., d_k:]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    pieces = []
    for i, m in enumerate(shard.chunk_lens):
        lo = shard.local_bounds[i]
        for slot, chunk in enumerate((shard.rank, 2 * shard.cp - 1 - shard.rank)):
            qs = q[lo + slot * m: lo + (slot + 1) * m]
            start = shard.bounds[i]
            end = shard.chunk_start(i, chunk) + m
            ks, vs = kf[start:end], vf[start:end]
            o = _lower_right_causal(*(t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs)), scale=scale)
            pieces.append(o[0].transpose(0, 1))
    return torch.cat(pieces, dim=0)
