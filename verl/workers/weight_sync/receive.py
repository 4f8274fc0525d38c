"""The receiving side of a trainer -> separate rollout pool sync for engines that generate with an HF module.

In the asynchronous modes the rollout pool holds its own copy of the policy (the built-in engine's module,
possibly FSDP-sharded over the rollout pool's ranks). :func:`load_hf_weights` copies full HF-named tensors, as
the trainer's ``get_per_tensor_param`` yields them, into that module in place, shard by shard.
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
    seen: set[str] = set()
    for name, full in weights:
        param = targets.get(name)
        if param is None:
            raise KeyError(f"weight sync: the rollout model has no parameter {name!r} "
                           f"(it has e.g. {sorted(targets)[:3]})")
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"weight sync: {name!r} arrives as {tuple(full.shape)}, the rollout model holds "
                             f"{tuple(param.shape)}")
        if DTensor and isinstance(param, DTensor):
            from torch.distributed.tensor import distribute_tensor

            # Every rollout rank receives the full tensor; each keeps its own shard (no communication).
            local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements,
                                      src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full.to(param.device, param.dtype))
        seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise KeyError(f"weight sync: the trainer sent no value for {len(missing)} rollout parameters, e.g. "
                       f"{missing[:3]}")
    return len(seen)
