"""Point-to-group tensor broadcast for server-mode weight sync (trainer -> separate rollout server).

The trainer and the rollout server are different processes with their own default process groups (or none),
so the sync uses a standalone two-party group built from a store: gloo on CPU, NCCL on CUDA, HCCL on Ascend.
On NPU the collective must be issued inside the communicator's device context and on the *current* stream,
otherwise HCCL may run on another device's default stream and the receiver reads a half-written buffer;
off NPU the behaviour is the plain one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


class PairCommunicator:
    """A standalone process group (no default group needed) with ``broadcast(tensor, src, stream)``."""

    def __init__(self, backend: str, store: Any, rank: int, world_size: int, device: Optional[torch.device] = None):
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(store, rank, world_size)
        elif backend == "nccl":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)
        elif backend == "hccl":
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL

            self.group = ProcessGroupHCCL(store, rank, world_size)
        else:
            raise ValueError(f"unknown backend {backend!r} (gloo, nccl or hccl)")

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if stream is not None and hasattr(stream, "__enter__"):
            with stream:
                self.group.broadcast([tensor], opts).wait()
        else:
            self.group.broadcast([tensor], opts).wait()

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, device=self.device), src=0)


def _npu_runtime() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def broadcast_tensor(communicator, tensor: torch.Tensor, src: int, device_module=None, on_npu: Optional[bool] = None):
    """Broadcast ``tensor`` from ``src`` through ``communicator`` (the one helper both sides use).

    ``device_module`` / ``on_npu`` exist for tests; by default they are ``torch.npu`` and "torch_npu works".
    """
    on_npu = _npu_runtime() if on_npu is None else on_npu
    if on_npu:
        mod = device_module if device_module is not None else torch.npu
        with mod.device(communicator.device):
            communicator.broadcast(tensor, src=src, stream=mod.current_stream())
        return
    stream = torch.cuda.current_stream() if tensor.is_cuda else None
    communicator.broadcast(tensor, src=src, stream=stream)
