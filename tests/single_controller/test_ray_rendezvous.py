"""The multi-node hand-off in ``verl/single_controller/ray.py``, without a Ray cluster.

``create_ray_worker_groups`` runs against a fake ``ray`` in which each placement-group bundle sits on a
different "node" with its own address, and ``ray.util.get_node_ip_address`` answers with the address of the
node the calling code runs on. So a regression to the old behaviour (driver-side 127.0.0.1, or the driver's
own address, or a port found on the driver) gives the wrong MASTER_ADDR here and the test fails. The real
two-node run is the slow ``test_ray_multinode.py``.
"""

from __future__ import annotations

import socket
import sys
import types
from collections import namedtuple

import pytest

from verl.single_controller import ray as ray_launcher
from verl.single_controller.ray import RayResourcePool

DRIVER_IP = "10.77.0.9"
NODE_OF_BUNDLE = {0: "10.77.0.1", 1: "10.77.0.2", 2: "10.77.0.2"}


class FakeCluster:
    """Just enough of Ray's API for ``create_ray_worker_groups``; records what each actor was given."""

    def __init__(self):
        self.running_on = DRIVER_IP  # the address get_node_ip_address answers with, i.e. where code runs now
        self.actor_options: list[dict] = []
        self.probe_bundles: list[int] = []

    def module(self) -> dict[str, types.ModuleType]:
        cluster = self
        ray = types.ModuleType("ray")
        util = types.ModuleType("ray.util")
        pg_mod = types.ModuleType("ray.util.placement_group")
        strat_mod = types.ModuleType("ray.util.scheduling_strategies")
        util.get_node_ip_address = lambda: cluster.running_on
        ray.util = util

        class Strategy:
            def __init__(self, pg, placement_group_bundle_index):
                self.bundle = placement_group_bundle_index

        class RemoteFunction:
            def __init__(self, fn, opts=None):
                self.fn, self.opts = fn, opts or {}

            def options(self, **opts):
                return RemoteFunction(self.fn, opts)

            def remote(self, *args):
                bundle = self.opts["scheduling_strategy"].bundle
                cluster.probe_bundles.append(bundle)
                before, cluster.running_on = cluster.running_on, NODE_OF_BUNDLE[bundle]
                try:
                    return ("value", self.fn(*args))
                finally:
                    cluster.running_on = before

        class FakeActor:
            class execute:  # noqa: N801 - mirrors Ray's ``actor.method.remote``
                @staticmethod
                def remote(*args):
                    return ("value", None)

            class where:  # noqa: N801 - (pid, host) of the actor's process, named when it dies
                @staticmethod
                def remote(*args):
                    return ("value", (1234, "node"))

        class ActorClass:
            def options(self, **opts):
                cluster.actor_options.append(opts)
                return self

            def remote(self, role_specs):
                return FakeActor()

        def remote(target=None, **_kw):
            if target is None:  # ray.remote(num_cpus=0)(fn)
                return lambda fn: RemoteFunction(fn)
            return ActorClass() if isinstance(target, type) else RemoteFunction(target)

        def get(ref, timeout=None):
            return [r[1] for r in ref] if isinstance(ref, list) else ref[1]

        ray.remote, ray.get = remote, get
        pg_mod.placement_group = lambda bundles, strategy: types.SimpleNamespace(ready=lambda: ("value", True))
        strat_mod.PlacementGroupSchedulingStrategy = Strategy
        return {"ray": ray, "ray.util": util, "ray.util.placement_group": pg_mod,
                "ray.util.scheduling_strategies": strat_mod}


@pytest.fixture
def cluster(monkeypatch):
    fake = FakeCluster()
    for name, mod in fake.module().items():
        monkeypatch.setitem(sys.modules, name, mod)
    return fake


class DummyWorker:  # create_ray_worker_groups only needs a class with (no) registered methods
    pass


@pytest.mark.parametrize("use_gpu", [False, True])
def test_rank0_node_address_and_port_reach_every_worker(cluster, use_gpu):
    pool = RayResourcePool([1, 2], use_gpu=use_gpu)
    groups = ray_launcher.create_ray_worker_groups(pool, {"actor": (DummyWorker, (), {})}, env={"EXTRA": "x"})
    assert groups["actor"].world_size == 3
    # The probe ran on rank 0's bundle, not on the driver and not on another node.
    assert cluster.probe_bundles == [0]
    envs = [o["runtime_env"]["env_vars"] for o in cluster.actor_options]
    assert [o["scheduling_strategy"].bundle for o in cluster.actor_options] == [0, 1, 2]
    assert {e["MASTER_ADDR"] for e in envs} == {NODE_OF_BUNDLE[0]}
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["LOCAL_RANK"] for e in envs] == (["0"] * 3 if use_gpu else ["0", "1", "2"])
    assert all(e["EXTRA"] == "x" for e in envs)


def test_probe_reports_the_node_address_and_a_port_free_there(cluster):
    cluster.running_on = "10.77.0.1"
    ip, port = ray_launcher.node_address_and_free_port()
    assert ip == "10.77.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # it was released, so it can be bound again
        s.bind(("", port))


Addr = namedtuple("Addr", "family address")


@pytest.fixture
def interfaces(monkeypatch):
    import psutil

    table = {"lo": [Addr(socket.AF_INET, "127.0.0.1")],
             "veth7": [Addr(socket.AF_INET6, "fe80::1"), Addr(socket.AF_INET, "10.77.0.2")]}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: table)


@pytest.mark.parametrize("node_ip, preset, expected", [
    ("10.77.0.2", None, "veth7"),        # the interface holding this node's Ray address
    ("10.77.0.2", "eth9", "eth9"),       # a user's own choice is kept
    ("127.0.0.1", None, None),           # loopback: leave gloo's choice alone
    ("10.99.0.5", None, None),           # no interface holds it (NAT'd address): leave gloo's choice alone
])
def test_gloo_socket_ifname(cluster, interfaces, node_ip, preset, expected):
    cluster.running_on = node_ip
    environ = {} if preset is None else {"GLOO_SOCKET_IFNAME": preset}
    ray_launcher.point_gloo_at_node_address(environ)
    assert environ.get("GLOO_SOCKET_IFNAME") == expected
