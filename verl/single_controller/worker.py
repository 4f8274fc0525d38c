"""Base class of every role that runs on a device: knows its rank and sets up torch.distributed once."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from verl.single_controller.profiler_worker import ProfilerWorkerMixin


class Worker(ProfilerWorkerMixin):  # the mixin adds start_profile / stop_profile (global_profiler.*)
    """A process-level worker. Rank and world size come from the environment the launcher sets."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    @staticmethod
    def ensure_process_group() -> None:
        """Join the default process group (gloo on CPU, nccl on GPU, hccl on NPU) if not done yet."""
        if dist.is_initialized():
            return
        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device

        if get_device_name() != "cpu":
            get_torch_device().set_device(int(os.environ.get("LOCAL_RANK", "0")))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            # A group of one needs no rendezvous: an in-process store binds no port, so none can be taken by another
            # process between choosing it and binding it (CI's parallel lanes hit EADDRINUSE in single-process SFT).
            dist.init_process_group(backend=get_nccl_backend(), store=dist.HashStore(), rank=0, world_size=1)
            return
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=get_nccl_backend(), rank=int(os.environ.get("RANK", "0")),
                                world_size=world_size)

    def ping(self) -> int:
        return self.rank

    def set_torch_threads(self, n: int) -> None:
        torch.set_num_threads(max(1, n))
