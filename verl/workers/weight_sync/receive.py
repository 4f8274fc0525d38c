"""The receiving side of a trainer -> separate rollout pool sync for engines that generate with an HF module.

In the asynchronous modes the rollout pool holds its own copy of the policy (the built-in engine's module,
possibly FSDP-sharded over the rollout pool's ranks). :func:`load_hf_weights` copies full HF-named tensors, as
the trainer's ``get_per_tensor_param`` yields them, into that module in place, shard by shard.

While a decode session holds the module's FSDP2 parameters gathered (``async_training.partial_rollout``: new
weights go in mid-generation), the gathered copy is what the engine reads, and its captured CUDA graphs read it at
fixed addresses: each tensor is copied into the gathered parameter in place *and* into the rank's shard, which
the next gather (the next session, validation) starts from.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .gather import DTensor
from .names import strip_wrapper_names


@torch.no_grad()
def load_hf_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy ``(hf_name, full tensor)`` pairs into ``module``'s parameters; returns how many were loaded.

    Every parameter of ``module`` must be received: a partial sync would leave the rollout generating with
    a mix of two policies, so a missing or unknown name is an error naming it."""
    targets = {strip_wrapper_names(name): p for name, p in module.named_parameters()}
    shard_of = _gathered_fsdp_params(module)
    seen: set[str] = set()
    for name, full in weights:
        param = targets.get(name)
        if param is None:
            raise KeyError(f"weight sync: the rollout model has no parameter {name!r} "
                           f"(it has e.g. {sorted(targets)[:3]})")
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"weight sync: {name!r} arrives as {tuple(full.shape)}, the rollout model holds "
                             f"{tuple(param.shape)}")
        sharded = shard_of.get(id(param))
        if sharded is not None:  # gathered right now: the live copy in place, and the shard
            param.copy_(full.to(param.device, param.dtype))
            _copy_shard(sharded, full)
        elif DTensor and isinstance(param, DTensor):
            _copy_shard(param, full)
        else:
            param.copy_(full.to(param.device, param.dtype))
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise KeyError(f"weight sync: the trainer sent no value for {len(missing)} rollout parameters, e.g. "
                       f"{missing[:3]}")
    return len(seen)


def _copy_shard(param, full: torch.Tensor) -> None:
    from torch.distributed.tensor import distribute_tensor

    # Every rollout rank receives the full tensor; each keeps its own shard (no communication).
    local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements,
                              src_data_rank=None)
    param.to_local().copy_(local.to_local())


def _gathered_fsdp_params(module: nn.Module) -> dict[int, nn.Parameter]:
    """FSDP2 parameters gathered right now: ``id`` of the gathered parameter (what ``named_parameters`` returns
    then) -> its sharded parameter. Empty for a plain module or one whose parameters are sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - no FSDP2 in this torch
        return {}
    from verl.utils.fsdp_utils import fsdp_param_groups

    out = {}
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        # FSDP2's internals (read on torch 2.13; fsdp_utils reads the same state): each FSDPParam knows its
        # state and both copies.
        for group in fsdp_param_groups(m._get_fsdp_state()):
            for fp in group.fsdp_params:
                if fp.sharded_state.name == "UNSHARDED":
                    out[id(fp.unsharded_param)] = fp.sharded_param
    return out
