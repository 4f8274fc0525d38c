"""Pieces both Qwen3.5 mixers use: the zero-centred RMSNorm, rotary helpers, packed-sequence bookkeeping and a
backward all-reduce for weights that are replicated over tensor ranks but see only local heads."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from verl.models.mcore import require_megatron

require_megatron()  # a clear "install the mcore extra" error before the first megatron import

from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Qwen3.5's RMSNorm: ``x / rms(x) * (1 + w)`` computed in fp32, cast back (w is stored zero-centred).

    Built by megatron-core's layer builders as ``norm(config=..., hidden_size=..., eps=...)``.
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32) if config is not None else torch.float32
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps
        # Under sequence parallelism each tensor rank normalises different tokens: megatron-core sums the
        # grads of parameters flagged like this over the tensor group.
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the grad over the tensor group (a weight shared by heads that are split
    over tensor ranks gets a partial grad on each rank)."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def tp_shared_weight(weight: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is None or tp_group.size() == 1 or not torch.is_grad_enabled():
        return weight
    return _SumGradOverTP.apply(weight, tp_group)


def tp_group_of(module: MegatronModule, pg_collection=None):
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp
    return parallel_state.get_tensor_model_parallel_group()


def cp_group_of(pg_collection=None):
    """The context-parallel group (None when context parallelism is off)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None or torch.distributed.get_world_size(group) == 1:
        return None
    return group


def cp_shard_of(packed_seq_params, group):
    """The :class:`~verl.models.mcore.context_parallel.CPShard` of this micro-batch (the model holds this CP
    rank's tokens; ``packed_seq_params`` carries the global, per-sequence padded boundaries). Built once per
    micro-batch and kept on the params object, so the layers share one host sync."""
    from verl.models.mcore.context_parallel import CPShard

    if packed_seq_params is None:
        raise ValueError("context parallelism needs packed (THD) input: set megatron.use_remove_padding=true")
    shard = getattr(packed_seq_params, "_verl_cp_shard", None)
    if shard is None:
        shard = CPShard.build(packed_cu_seqlens(packed_seq_params), torch.distributed.get_world_size(group),
                              torch.distributed.get_rank(group))
        packed_seq_params._verl_cp_shard = shard
    return shard


def recomputes(config, module_name: str) -> bool:
    """Whether selective activation recompute covers ``module_name`` ("core_attn", "gdn_norm_out")."""
    return getattr(config, "recompute_granularity", None) == "selective" and module_name in (
        getattr(config, "recompute_modules", None) or ())


def maybe_checkpoint(enabled: bool, fn, *args):
    """Run ``fn`` under non-reentrant activation checkpointing when ``enabled`` (no RNG inside: deterministic)."""
    if enabled and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of every head (non-interleaved halves); pass the rest."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


def packed_cu_seqlens(packed_seq_params) -> Optional[torch.Tensor]:
    """Boundaries of the sequences in a THD batch as laid out in memory (padded boundaries when given)."""
    if packed_seq_params is None:
        return None
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    return cu


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: RMS-normalise in fp32, scale by ``weight`` (plain, not zero-centred) in the
    input dtype, multiply by silu(gate) in fp32 (Qwen3.5's order of casts)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)
