"""Worker groups: one object on the controller that fans a call out to every rank and joins the results.

Two launchers share the dispatch logic here: :class:`LocalWorkerGroup` runs one rank in this process (the
lent GPU machine has no Ray, and it is the easiest way to debug), and ``RayWorkerGroup`` in ``ray.py`` runs
one Ray actor per device. Several roles can share those processes (``ColocatedWorker``): actor, rollout,
reference and critic then live on the same device and the same torch.distributed group.
"""

from __future__ import annotations

from typing import Any, Callable

from verl.single_controller.decorator import Dispatch, Execute, registered_methods
from verl.single_controller.dp_layout import DataParallelLayout
from verl.utils.user_errors import UserFacingError


class WorkerDied(UserFacingError):
    """A worker process ended (killed, OOM, crashed) while the controller waited on it. Raised as soon as the
    first rank's death is known, without waiting for the other ranks (which may be stuck in a collective with the
    dead one): one paragraph naming the roles and rank, exit code 1."""

    def __init__(self, message: str, hint: str = "", kind: str = "Worker"):
        super().__init__(kind, message, hint)

    def __reduce__(self):
        return (type(self), (self.message, self.hint, self.kind))


def _split_proto(data, world_size: int):
    from verl.protocol import DataProto

    if isinstance(data, DataProto):
        if len(data) % world_size != 0:
            raise ValueError(
                f"a batch of {len(data)} rows cannot be split evenly over {world_size} data-parallel ranks; "
                "make data.train_batch_size * rollout.n divisible by the number of GPUs (trainer.n_gpus_per_node"
                " * trainer.nnodes)"
            )
        return data.chunk(world_size)
    return [data] * world_size


def dispatch_args(mode: Dispatch, world_size: int, args: tuple, kwargs: dict,
                  layout: DataParallelLayout | None = None) -> list[tuple[tuple, dict]]:
    """Per-rank (args, kwargs) for a call in the given dispatch mode.

    DP modes split each DataProto into one chunk per data-parallel replica of ``layout`` (default: one replica
    per rank) and give every rank its replica's chunk.
    """
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        return [(args, kwargs)] * world_size
    if mode == Dispatch.ALL_TO_ALL:
        per_rank = []
        for r in range(world_size):
            per_rank.append((tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}))
        return per_rank
    if mode in (Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_METRIC):
        layout = _layout_for(layout, world_size)
        split_args = [_split_proto(a, layout.dp_size) for a in args]
        split_kwargs = {k: _split_proto(v, layout.dp_size) for k, v in kwargs.items()}
        per_dp = [(tuple(s[d] for s in split_args), {k: v[d] for k, v in split_kwargs.items()})
                  for d in range(layout.dp_size)]
        return [per_dp[layout.replica_of[r]] for r in range(world_size)]
    raise ValueError(f"unknown dispatch mode {mode}")


def _layout_for(layout: DataParallelLayout | None, world_size: int) -> DataParallelLayout:
    layout = layout or DataParallelLayout.blocks(world_size)
    if layout.world_size != world_size:
        raise ValueError(f"data-parallel layout covers {layout.world_size} ranks; the worker group has {world_size}")
    return layout


def collect_results(mode: Dispatch, outputs: list[Any], layout: DataParallelLayout | None = None):
    """Join per-rank outputs. DP modes given every rank's output keep the one ``layout.collect_from`` names for
    each replica, in replica order: the other ranks of a replica computed the same thing on the same chunk."""
    if mode == Dispatch.RANK_ZERO:
        return outputs[0]
    if mode in (Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_METRIC) and layout is not None:
        outputs = [outputs[r] for r in _layout_for(layout, len(outputs)).collect_from]
    if mode == Dispatch.DP_COMPUTE_PROTO:
        from verl.protocol import DataProto

        if all(isinstance(o, DataProto) for o in outputs):
            return DataProto.concat(outputs)
        return outputs
    return outputs


class WorkerGroup:
    """Fans out every method registered on ``worker_cls``; subclasses provide ``_call_ranks``."""

    def __init__(self, worker_cls: type, world_size: int, role: str | None = None,
                 layout: DataParallelLayout | None = None):
        self.world_size = world_size
        self._role = role
        # Which replica each rank serves; fewer replicas than ranks under sequence / model parallelism.
        self.layout = _layout_for(layout, world_size)
        self.dp_size = self.layout.dp_size
        for name, spec in registered_methods(worker_cls).items():
            setattr(self, name, self._make_method(name, spec))

    def _call_ranks(self, method: str, per_rank: list[tuple[tuple, dict]], ranks: list[int]) -> list[Any]:
        raise NotImplementedError

    def _make_method(self, name: str, spec: dict) -> Callable:
        mode, execute = spec["dispatch_mode"], spec["execute_mode"]

        def call(*args, **kwargs):
            per_rank = dispatch_args(mode, self.world_size, args, kwargs, self.layout)
            ranks = [0] if (execute == Execute.RANK_ZERO or mode == Dispatch.RANK_ZERO) else list(range(self.world_size))
            outputs = self._call_ranks(name, [per_rank[r] for r in ranks], ranks)
            return collect_results(mode, outputs, self.layout if len(ranks) == self.world_size else None)

        call.__name__ = name
        call.worker_group = self  # lets the trainer pad a batch to this group's data-parallel size
        return call


class ColocatedWorker:
    """Hosts several roles in one process; methods are reached as ``execute(role, method, *args)``."""

    def __init__(self, role_specs: dict[str, tuple[type, tuple, dict]]):
        from verl.single_controller.worker import Worker

        Worker.ensure_process_group()
        _limit_cpu_threads()
        self.roles = {role: cls(*a, **kw) for role, (cls, a, kw) in role_specs.items()}

    def execute(self, role: str, method: str, args: tuple, kwargs: dict):
        return getattr(self.roles[role], method)(*args, **kwargs)


def _limit_cpu_threads() -> None:
    """On CPU, the in-process worker's intra-op threads (:func:`verl.utils.device.cpu_threads_per_worker`)."""
    import torch

    from verl.utils.device import cpu_threads_per_worker, get_device_name

    if get_device_name() == "cpu":
        torch.set_num_threads(cpu_threads_per_worker(1))


class LocalWorkerGroup(WorkerGroup):
    """Runs every role of rank 0 in this process (world size 1), without Ray."""

    def __init__(self, host: ColocatedWorker, role: str, worker_cls: type):
        self._host = host
        super().__init__(worker_cls, world_size=1, role=role)

    def _call_ranks(self, method, per_rank, ranks):
        return [self._host.execute(self._role, method, a, kw) for a, kw in per_rank]


def create_local_worker_groups(role_specs: dict[str, tuple[type, tuple, dict]],
                               dp_layouts: dict[str, DataParallelLayout] | None = None) -> dict[str, WorkerGroup]:
    """One in-process host for all roles, and one worker group per role."""
    import os

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if "MASTER_PORT" not in os.environ:
        from verl.utils.net import find_free_port

        os.environ["MASTER_PORT"] = str(find_free_port())
    host = ColocatedWorker(role_specs)
    groups = {role: LocalWorkerGroup(host, role, spec[0]) for role, spec in role_specs.items()}
    for role, layout in (dp_layouts or {}).items():
        if layout.world_size != 1:
            raise ValueError(f"the local launcher runs one rank; role {role!r} has a data-parallel layout over "
                             f"{layout.world_size} ranks")
    return groups
