"""Ray launcher: one actor process per device, hosting all colocated roles of that rank."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from verl.single_controller.dp_layout import DataParallelLayout
from verl.single_controller.worker_group import ColocatedWorker, WorkerDied, WorkerGroup
from verl.utils.net import find_free_port


def node_address_and_free_port() -> tuple[str, int]:
    """Run on rank 0's node: the address other nodes reach it at (Ray's node IP) and a port free there
    (bound on every interface, so free on the node address too)."""
    import ray

    ip = ray.util.get_node_ip_address()
    return ip, find_free_port("")


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` (None if none does, or it is loopback)."""
    import psutil

    if ip.startswith("127."):
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def point_gloo_at_node_address(environ) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``environ`` to the interface holding this node's Ray address, unless the
    user set it or that address is loopback / on no interface (gloo's own choice is then as good as ours)."""
    import ray

    if "GLOO_SOCKET_IFNAME" in environ:
        return
    iface = interface_of(ray.util.get_node_ip_address())
    if iface:
        environ["GLOO_SOCKET_IFNAME"] = iface


def rank_env_vars(rank: int, world_size: int, use_gpu: bool, master_addr: str, master_port: int,
                  env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank ``rank``: the caller's ``env`` plus torch.distributed's rendezvous variables.
    Every rank gets the same ``MASTER_ADDR`` / ``MASTER_PORT``: those found on rank 0's node."""
    return {**(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0" if use_gpu else str(rank),
            "MASTER_ADDR": str(master_addr), "MASTER_PORT": str(master_port)}


class RayColocatedWorker(ColocatedWorker):
    """The Ray actor: before joining the process group, gloo is told to use the interface of this node's Ray
    address. Left alone it resolves the hostname, which is often 127.0.0.1, and ranks on other nodes can then
    never connect (the group set-up hangs)."""

    def __init__(self, role_specs):
        import os

        point_gloo_at_node_address(os.environ)
        super().__init__(role_specs)

    def where(self) -> tuple[int, str]:
        """(pid, host name) of this worker process."""
        import os

        return os.getpid(), socket.gethostname()


@dataclass
class RayResourcePool:
    """``process_on_nodes[i]`` worker processes on node i; one device each when ``use_gpu``."""

    process_on_nodes: list[int]
    use_gpu: bool = True
    cpus_per_worker: float = 1.0
    device_resource: str = "GPU"  # "NPU" on Ascend

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)


class RayWorkerGroup(WorkerGroup):
    def __init__(self, actors: list, role: str, worker_cls: type, layout: DataParallelLayout | None = None,
                 hosted_roles: tuple[str, ...] = (), pids: list | None = None):
        self._actors = actors
        self._hosted = tuple(hosted_roles) or (role,)
        self._pids = list(pids or [None] * len(actors))
        super().__init__(worker_cls, world_size=len(actors), role=role, layout=layout)

    def _call_ranks(self, method, per_rank, ranks):
        import ray

        refs = [self._actors[r].execute.remote(self._role, method, a, kw) for r, (a, kw) in zip(ranks, per_rank)]
        return wait_all(refs, ranks, lambda rank, err: self._died(method, rank, err))

    def _died(self, method: str, rank: int, err: BaseException) -> WorkerDied:
        pid = self._pids[rank] if rank < len(self._pids) else None
        host = f"rank {rank}" + (f" (pid {pid[0]} on {pid[1]})" if pid else "")
        roles = ", ".join(self._hosted)
        return WorkerDied(
            f"the worker process of {host}, hosting {roles}, died while running {self._role}.{method}: "
            f"{death_reason(err)}",
            "Nothing of the current step was saved. Look at that worker's log above (an out-of-memory kill, a "
            "crash in a kernel, the node going away); fix the cause or lower the memory use "
            "(micro-batch sizes, rollout.gpu_memory_utilization, offloading), then start the same command again: "
            "trainer.resume_mode=auto resumes from the latest complete checkpoint.")


_DEATH_ERRORS: tuple = ()


def _death_errors() -> tuple:
    """Ray's exceptions for a worker process that is gone (actor death, a crashed worker, an OOM kill)."""
    global _DEATH_ERRORS
    if not _DEATH_ERRORS:
        import ray.exceptions as rex

        names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
                 "OutOfMemoryError", "NodeDiedError")
        _DEATH_ERRORS = tuple(getattr(rex, n) for n in names if hasattr(rex, n))
    return _DEATH_ERRORS


def death_reason(err: BaseException) -> str:
    """The first sentences of Ray's explanation (it names SIGKILL / OOM / exit codes where it knows them)."""
    text = " ".join(str(err).split())
    for marker in ("The actor died", "The actor is dead", "Worker exit", "The worker died", "Task was killed"):
        i = text.find(marker)
        if i >= 0:
            text = text[i:]
            break
    cut = text.find(" Some common causes")  # Ray's generic list of causes; the exit detail before it is the news
    if cut > 0:
        text = text[:cut]
    return (text[:400] + " ...") if len(text) > 400 else (text or type(err).__name__)


def wait_all(refs: list, ranks: list[int], on_death) -> list:
    """``ray.get(refs)``, except that the first rank to fail is reported as soon as it fails: a process that died
    raises ``on_death(rank, error)``, a worker's exception is raised as it is. A plain ``ray.get`` waits for the
    refs in order, so it would first wait on a live rank blocked in a collective with the failed one (gloo/NCCL
    timeouts: many minutes) before reporting anything."""
    import ray

    rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                ray.get(ref)
            except _death_errors() as err:
                raise on_death(rank_of[ref], err) from err
            # A worker's own exception propagates from ray.get right away too (other ranks may wait on it in a
            # collective as well).
    return ray.get(refs)


def create_ray_worker_groups(pool: RayResourcePool, role_specs: dict[str, tuple[type, tuple, dict]],
                             env: dict[str, str] | None = None,
                             dp_layouts: dict[str, DataParallelLayout] | None = None) -> dict[str, WorkerGroup]:
    """Start ``pool.world_size`` actors in a placement group and return one worker group per role.

    ``dp_layouts[role]`` says which data-parallel replica each rank of that role serves (default: one replica
    per rank); see ``WorkerGroup``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle: dict[str, Any] = {"CPU": pool.cpus_per_worker}
    if pool.use_gpu:
        bundle[pool.device_resource] = 1
    pg = placement_group([dict(bundle) for _ in range(pool.world_size)], strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    # torch.distributed's rendezvous lives with rank 0: its node's address and a port free on that node, found
    # there (a driver-side 127.0.0.1 and driver-side port only work when every rank shares the driver's host).
    probe = ray.remote(num_cpus=0)(node_address_and_free_port).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
    master_addr, master_port = ray.get(probe.remote(), timeout=120)
    actor_cls = ray.remote(RayColocatedWorker)
    actors = []
    for rank in range(pool.world_size):
        runtime_env = {"env_vars": rank_env_vars(rank, pool.world_size, pool.use_gpu, master_addr, master_port, env)}
        opts = dict(num_cpus=pool.cpus_per_worker, runtime_env=runtime_env,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
        if pool.use_gpu:
            if pool.device_resource == "GPU":
                opts["num_gpus"] = 1
            else:
                opts["resources"] = {pool.device_resource: 1}
        actors.append(actor_cls.options(**opts).remote(role_specs))
    # Surface constructor failures (bad model path, OOM) here rather than on the first call; learn each rank's
    # process, so that a rank that dies later is named with it.
    ray.get([a.execute.remote(next(iter(role_specs)), "ping", (), {}) for a in actors])
    pids = ray.get([a.where.remote() for a in actors])
    dp_layouts = dp_layouts or {}
    return {role: RayWorkerGroup(actors, role, spec[0], layout=dp_layouts.get(role), hosted_roles=tuple(role_specs),
                                 pids=pids) for role, spec in role_specs.items()}
