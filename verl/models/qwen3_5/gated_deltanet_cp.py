"""Gated DeltaNet under context parallelism (packed THD rows sharded by :class:`verl.models.mcore.context_parallel.
CPShard`: rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every sequence). Plain torch + torch.distributed;
the conv and delta-rule kernels are the ones of :mod:`verl.models.qwen3_5.gated_deltanet` (fla on CUDA, the torch
reference elsewhere), so the CP math is tested on CPU with gloo.

Two things cross chunk boundaries, and both are passed exactly:

* the short causal conv reads the ``kernel - 1`` tokens before each chunk (its halo). Every rank's chunk tails
  (the last ``min(m, kernel - 1)`` tokens of each chunk) are all-gathered, and each local chunk runs the conv as
  its own sequence prefixed by its halo. Cost: one all-gather of ``2 (kernel - 1)`` tokens per sequence per layer.
* the delta rule's recurrent state. The chunks of a sequence are processed in order, chunk ``j`` on its owner
  starting from the final state of chunk ``j - 1``, received point-to-point (``[N, H, K, V]`` fp32, N the number of
  sequences: every sequence's chunk ``j`` runs in one varlen kernel call). Backward walks the chunks in reverse,
  passing d(state) back the same way, and recomputes each chunk's forward from its saved inputs and incoming
  state (nothing of the kernel's internals is kept between forward and backward).
  Cost: the recurrence is serial over the ``2 cp`` chunks - each rank computes 2 of them and waits for the others,
  so the delta rule itself runs no faster than at CP=1 (its activations are split ``cp`` ways, which is what long
  sequences need) - plus ``2 cp - 2`` state transfers each way per layer and one recomputed chunk forward in
  backward. The projections, the conv, the norms, the MLPs and attention run in parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.models.mcore.context_parallel import CPShard, all_gather_cp, chunk_owner
from verl.models.qwen3_5.gated_deltanet import causal_conv1d, gated_delta_rule

__all__ = ["cp_causal_conv1d", "cp_gated_delta_rule"]


# ------------------------------------------------------------------------------------------------------------------
# Short causal conv with a halo from the previous chunk
# ------------------------------------------------------------------------------------------------------------------


def _conv_plan(shard: CPShard, halo: int):
    """Index plan for :func:`cp_causal_conv1d` (pure index arithmetic, cached per shard and halo).

    Returns (tail_index [n_tail] local positions of this rank's chunk tails, ext_source [T_ext] rows of
    ``cat(local, gathered tails)`` forming the extended row, ext_cu int32 boundaries of its segments, keep
    [T_local] positions of the local tokens in the extended row)."""
    cache = shard.__dict__.setdefault("_conv_plans", {})
    if halo in cache:
        return cache[halo]
    cp, rank = shard.cp, shard.rank
    tails = [min(m, halo) for m in shard.chunk_lens]
    # tail buffer of every rank: sequence after sequence, slot 0's tail then slot 1's
    offsets, n_tail = [], 0
    for t in tails:
        offsets.append(n_tail)
        n_tail += 2 * t
    tail_index = []
    for i, (lo, m, t) in enumerate(zip(shard.local_bounds[:-1], shard.chunk_lens, tails)):
        for slot in (0, 1):
            end = lo + (slot + 1) * m
            tail_index.extend(range(end - t, end))
    local_total = shard.local_len
    ext_source, ext_cu, keep = [], [0], []
    for i, (lo, m, t) in enumerate(zip(shard.local_bounds[:-1], shard.chunk_lens, tails)):
        for slot, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            start = chunk * m  # position of the chunk in its sequence
            for p in range(max(0, start - halo), start):  # the halo: true predecessors, from their chunks' tails
                j, off = divmod(p, m)
                owner, owner_slot = chunk_owner(j, cp)
                # p lies in the last min(m, halo) tokens of chunk j (p >= start - halo, chunk j ends <= start)
                pos_in_tail = off - (m - t)
                ext_source.append(local_total + owner * n_tail + offsets[i] + owner_slot * t + pos_in_tail)
            keep.extend(range(len(ext_source), len(ext_source) + m))
            ext_source.extend(range(lo + slot * m, lo + (slot + 1) * m))
            ext_cu.append(len(ext_source))
    dev = shard.device
    plan = (torch.tensor(tail_index, dtype=torch.long, device=dev), torch.tensor(ext_source, dtype=torch.long,
            device=dev), torch.tensor(ext_cu, dtype=torch.int32, device=dev),
            torch.tensor(keep, dtype=torch.long, device=dev))
    cache[halo] = plan
    return plan


def cp_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias, shard: CPShard, group,
                     activation: str = "silu") -> torch.Tensor:
    """Depthwise causal conv of a CP-local packed row ``x`` [1, T_local, C] with ``weight`` [C, W]: equal to the
    conv of the full row, restarted at every sequence start, taken at this rank's positions."""
    if x.shape[0] != 1:
        raise ValueError("context-parallel conv expects one packed row")
    halo = weight.shape[-1] - 1
    tail_index, ext_source, ext_cu, keep = _conv_plan(shard, halo)
    rows = x[0]
    if halo > 0:
        tails = all_gather_cp(rows.index_select(0, tail_index), group)
        rows = torch.cat([rows, tails], dim=0)
    ext = rows.index_select(0, ext_source).unsqueeze(0)
    out = causal_conv1d(ext, weight, bias, ext_cu, activation)
    return out[:, keep]


# ------------------------------------------------------------------------------------------------------------------
# Delta rule with the state relayed from chunk to chunk
# ------------------------------------------------------------------------------------------------------------------


def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _chunk_inputs(tensors, shard: CPShard, slot: int):
    idx = shard.slot_index(slot)
    return [t.index_select(1, idx) for t in tensors]


def _run_chunk(inputs, shard: CPShard, state, use_qk_l2norm: bool):
    cu = shard.chunk_cu_seqlens
    return gated_delta_rule(*inputs, cu_seqlens=cu, max_seqlen=max(shard.chunk_lens), use_qk_l2norm=use_qk_l2norm,
                            initial_state=state, output_final_state=True)


def _state_shape(shard: CPShard, q, v):
    return (shard.num_seqs, v.shape[2], q.shape[3], v.shape[3])


def _relay_forward(q, k, v, g, beta, shard: CPShard, group, use_qk_l2norm: bool):
    """Forward over the 2 cp chunks in order. Returns (output [1, T_local, H, V], incoming states of this rank's
    slots: {slot: state or None})."""
    cp, rank = shard.cp, shard.rank
    out = None
    incoming = {}
    state = None  # the final state of the chunk just processed, on the rank that needs it next
    for j in range(2 * cp):
        owner, slot = chunk_owner(j, cp)
        if owner == rank:
            incoming[slot] = state
            o, final = _run_chunk(_chunk_inputs((q, k, v, g, beta), shard, slot), shard, state, use_qk_l2norm)
            if out is None:
                out = o.new_zeros((1, q.shape[1], *o.shape[2:]))
            out[:, shard.slot_index(slot)] = o
            state = final.float()
        if j + 1 < 2 * cp:
            nxt, _ = chunk_owner(j + 1, cp)
            if owner != nxt:  # hand the state to the next chunk's owner
                if owner == rank:
                    dist.send(state.contiguous(), _global(group, nxt), group=group)
                elif nxt == rank:
                    state = torch.empty(_state_shape(shard, q, v), dtype=torch.float32, device=q.device)
                    dist.recv(state, _global(group, owner), group=group)
    return out, incoming


class _RelayDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, shard, group, use_qk_l2norm):
        out, incoming = _relay_forward(q, k, v, g, beta, shard, group, use_qk_l2norm)
        ctx.shard, ctx.group, ctx.l2 = shard, group, use_qk_l2norm
        ctx.has_state = tuple(incoming[s] is not None for s in (0, 1))
        states = [incoming[s] if incoming[s] is not None else q.new_empty(0) for s in (0, 1)]
        ctx.save_for_backward(q, k, v, g, beta, *states)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, g, beta, s0, s1 = ctx.saved_tensors
        shard, group = ctx.shard, ctx.group
        cp, rank = shard.cp, shard.rank
        incoming = {0: s0 if ctx.has_state[0] else None, 1: s1 if ctx.has_state[1] else None}
        grads = [torch.zeros_like(t) for t in (q, k, v, g, beta)]
        d_state = None  # d(loss)/d(final state of chunk j), on the owner of chunk j
        for j in reversed(range(2 * cp)):
            owner, slot = chunk_owner(j, cp)
            if j + 1 < 2 * cp:
                nxt, _ = chunk_owner(j + 1, cp)
                if owner != nxt:  # d(state) travels back from the next chunk's owner
                    if nxt == rank:
                        dist.send(d_state.contiguous(), _global(group, owner), group=group)
                    elif owner == rank:
                        d_state = torch.empty(_state_shape(shard, q, v), dtype=torch.float32, device=q.device)
                        dist.recv(d_state, _global(group, nxt), group=group)
            if owner != rank:
                continue
            idx = shard.slot_index(slot)
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in
                          _chunk_inputs((q, k, v, g, beta), shard, slot)]
                s_in = incoming[slot]
                if s_in is not None:
                    s_in = s_in.detach().requires_grad_(True)
                o, final = _run_chunk(leaves, shard, s_in, ctx.l2)
                outs, outs_grad = [o], [grad_out.index_select(1, idx)]
                if j + 1 < 2 * cp:
                    outs.append(final)
                    outs_grad.append(d_state)
                inputs = leaves + ([s_in] if s_in is not None else [])
                got = torch.autograd.grad(outs, inputs, outs_grad, allow_unused=True)
            for acc, gr in zip(grads, got[:5]):
                if gr is not None:
                    acc.index_add_(1, idx, gr.to(acc.dtype))
            d_state = got[5] if s_in is not None else None
            if d_state is None and j > 0:
                d_state = torch.zeros(_state_shape(shard, q, v), dtype=torch.float32, device=q.device)
        return (*grads, None, None, None)


def cp_gated_delta_rule(q, k, v, g, beta, shard: CPShard, group, use_qk_l2norm: bool = True) -> torch.Tensor:
    """Gated delta rule of a CP-local packed row (q/k/v [1, T_local, H, D], g/beta [1, T_local, H]), equal to
    the rule over the full row (every sequence from a zero state) at this rank's positions."""
    if q.shape[0] != 1:
        raise ValueError("context-parallel delta rule expects one packed row")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        return _RelayDeltaRule.apply(q, k, v, g, beta, shard, group, use_qk_l2norm)
    return _relay_forward(q, k, v, g, beta, shard, group, use_qk_l2norm)[0]
