"""Ulysses sequence parallelism: process-group registry, input padding/slicing and all-to-all primitives.

Each rank of a sequence-parallel (SP) group holds a contiguous 1/sp slice of the packed token row. Layers
that need the whole sequence (attention, Gated DeltaNet) trade it for a slice of heads with an all-to-all,
compute, and trade back. Outputs are gathered along the sequence with :func:`gather_outputs_and_unpad`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

_SP_GROUP: Optional[ProcessGroup] = None


def set_ulysses_sequence_parallel_group(group: Optional[ProcessGroup]):
    """Register the SP group used by patched models (None disables SP)."""
    global _SP_GROUP
    _SP_GROUP = group


def get_ulysses_sequence_parallel_group() -> Optional[ProcessGroup]:
    return _SP_GROUP


def get_ulysses_sequence_parallel_world_size(group: Optional[ProcessGroup] = None) -> int:
    group = _SP_GROUP if group is None else group
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def get_ulysses_sequence_parallel_rank(group: Optional[ProcessGroup] = None) -> int:
    group = _SP_GROUP if group is None else group
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------------------
# Collectives
# ----------------------------------------------------------------------------------------------------------------


def all_to_all_tensor(x: Tensor, scatter_dim: int, gather_dim: int, group: Optional[ProcessGroup] = None) -> Tensor:
    """Split ``x`` into world-size chunks along ``scatter_dim``, send chunk i to rank i, and concatenate the
    received chunks (in rank order) along ``gather_dim``."""
    group = _SP_GROUP if group is None else group
    world = dist.get_world_size(group)
    if world == 1:
        return x
    sends = [c.contiguous() for c in torch.tensor_split(x, world, dim=scatter_dim)]
    recvs = [torch.empty_like(sends[0]) for _ in range(world)]
    dist.all_to_all(recvs, sends, group=group)
    return torch.cat(recvs, dim=gather_dim).contiguous()


def all_gather_tensor(x: Tensor, dim: int = 0, group: Optional[ProcessGroup] = None) -> Tensor:
    """Plain (non-differentiable) all-gather concatenated along ``dim``; for index-like tensors."""
    group = _SP_GROUP if group is None else group
    world = dist.get_world_size(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class SeqAllToAll(torch.autograd.Function):
    """Differentiable all-to-all; the backward is the all-to-all with the two dims swapped."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, local_input: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all_tensor(local_input, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor):
        grad = all_to_all_tensor(grad_output.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group)
        return None, grad, None, None


def _pad_dim(x: Tensor, dim: int, amount: int) -> Tensor:
    if amount <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = amount
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _unpad_dim(x: Tensor, dim: int, amount: int) -> Tensor:
    if amount <= 0:
        return x
    return x.narrow(dim, 0, x.shape[dim] - amount)


def gather_seq_scatter_heads(
    x: Tensor, seq_dim: int, head_dim: int, unpadded_dim_size: int = 0, group: Optional[ProcessGroup] = None
) -> Tensor:
    """Sequence-sharded -> head-sharded. ``unpadded_dim_size`` (if set) is the true full sequence length:
    the gathered sequence is cut back to it (inputs were padded to a multiple of sp)."""
    group = _SP_GROUP if group is None else group
    if group is None:
        return x
    world = dist.get_world_size(group)
    x = SeqAllToAll.apply(group, x, head_dim, seq_dim)
    if unpadded_dim_size and unpadded_dim_size % world != 0:
        x = _unpad_dim(x, seq_dim, x.shape[seq_dim] - unpadded_dim_size)
    return x


def gather_heads_scatter_seq(x: Tensor, head_dim: int, seq_dim: int, group: Optional[ProcessGroup] = None) -> Tensor:
    """Head-sharded -> sequence-sharded; pads the sequence to a multiple of sp first when needed."""
    group = _SP_GROUP if group is None else group
    if group is None:
        return x
    world = dist.get_world_size(group)
    x = _pad_dim(x, seq_dim, (-x.shape[seq_dim]) % world)
    return SeqAllToAll.apply(group, x, seq_dim, head_dim)


class _GatherSeq(torch.autograd.Function):
    """All-gather along a dim; the backward keeps this rank's slice (optionally scaled by the group size,
    because data-parallel gradient averaging also divides by the SP ranks that computed the same loss)."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, x: Tensor, dim: int, grad_scaler: bool) -> Tensor:
        world = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.grad_scaler, ctx.world = group, dim, grad_scaler, world
        ctx.rank = dist.get_rank(group)
        ctx.local = x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        local = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local)
        if ctx.grad_scaler:
            local = local * ctx.world
        return None, local.contiguous(), None, None


def gather_outputs_and_unpad(
    x: Tensor,
    gather_dim: int,
    unpad_dim: Optional[int] = None,
    padding_size: int = 0,
    grad_scaler: bool = True,
    group: Optional[ProcessGroup] = None,
) -> Tensor:
    """Gather sequence shards (e.g. per-token log-probs) and drop the ``padding_size`` pad added before
    slicing. Identity when SP is off."""
    group = _SP_GROUP if group is None else group
    if group is None or dist.get_world_size(group) == 1:
        return x
    x = _GatherSeq.apply(group, x, gather_dim, grad_scaler)
    if unpad_dim is not None:
        x = _unpad_dim(x, unpad_dim, padding_size)
    return x


# Upstream keeps this misspelt alias; callers ported from it still use it.
gather_outpus_and_unpad = gather_outputs_and_unpad


# ----------------------------------------------------------------------------------------------------------------
# Input preparation
# ----------------------------------------------------------------------------------------------------------------


def slice_input_tensor(x: Tensor, dim: int, padding: bool = True, group: Optional[ProcessGroup] = None) -> Tensor:
    """This rank's contiguous 1/sp slice along ``dim`` (padding to a multiple of sp first if asked)."""
    group = _SP_GROUP if group is None else group
    world = get_ulysses_sequence_parallel_world_size(group)
    if world == 1:
        return x
    rank = get_ulysses_sequence_parallel_rank(group)
    if padding:
        x = _pad_dim(x, dim, (-x.shape[dim]) % world)
    size = x.shape[dim] // world
    return x.narrow(dim, rank * size, size).contiguous()


def ulysses_pad(input_ids_rmpad: Tensor, position_ids_rmpad: Optional[Tensor] = None, sp_size: int = 1, pad_value=0):
    """Right-pad a packed row (1, T) to a multiple of ``sp_size``.

    The pad tokens get positions 0, 1, ... so a patched model sees them as one extra short sequence and they
    never attend to, or feed the recurrent state of, the real last sequence. Returns (ids, positions, pad).
    """
    if position_ids_rmpad is not None and position_ids_rmpad.shape[-1] != input_ids_rmpad.shape[-1]:
        raise ValueError("input_ids and position_ids must have the same packed length")
    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, 0
    pad = (-input_ids_rmpad.shape[-1]) % sp_size
    if pad == 0:
        return input_ids_rmpad, position_ids_rmpad, 0
    input_ids_rmpad = torch.nn.functional.pad(input_ids_rmpad, (0, pad), value=pad_value)
    if position_ids_rmpad is not None:
        extra = torch.arange(pad, device=position_ids_rmpad.device, dtype=position_ids_rmpad.dtype)
        extra = extra.expand(*position_ids_rmpad.shape[:-1], pad)
        position_ids_rmpad = torch.cat([position_ids_rmpad, extra], dim=-1)
    return input_ids_rmpad, position_ids_rmpad, pad


def ulysses_pad_and_slice_inputs(
    input_ids_rmpad: Tensor,
    position_ids_rmpad: Optional[Tensor] = None,
    sp_size: int = 1,
    skip_position_ids_rmpad: bool = False,
    pad_value=0,
):
    """Pad to a multiple of sp and keep this rank's slice of ids (and positions unless skipped).

    Patched Qwen3.5 models accept either sliced or full position ids: they all-gather sliced ones to find
    sequence boundaries over the whole row.
    """
    input_ids_rmpad, position_ids_rmpad, pad = ulysses_pad(input_ids_rmpad, position_ids_rmpad, sp_size, pad_value)
    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, pad
    input_ids_rmpad = slice_input_tensor(input_ids_rmpad, dim=-1, padding=False)
    if position_ids_rmpad is not None and not skip_position_ids_rmpad:
        position_ids_rmpad = slice_input_tensor(position_ids_rmpad, dim=-1, padding=False)
    return input_ids_rmpad, position_ids_rmpad, pad


def validate_ulysses_config(num_heads: int, ulysses_sequence_size: int) -> None:
    if ulysses_sequence_size > 1 and num_heads % ulysses_sequence_size != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by the Ulysses sequence parallel size ({ulysses_sequence_size})"
        )
