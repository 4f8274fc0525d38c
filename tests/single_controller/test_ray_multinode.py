"""Ray across two machines, on one machine: two Ray nodes in two network namespaces that this test creates
(10.77.0.1 and 10.77.0.2 on a veth pair), and 2 GRPO steps of the demo with trainer.nnodes=2.

Before the fix every worker got MASTER_ADDR=127.0.0.1 and the process-group set-up hung. Needs root (or
CAP_NET_ADMIN) for `ip netns`; skipped with the reason otherwise, except where VERL_REQUIRE_NETNS=1 (set by
`.ci/run` and the CI job): there a skip would let CI go green without this test, so it fails instead.
Bounded in time; cleans up after itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.trainer.e2e_utils import REPO, demo_dir

RAY_PORT = 6388
ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_usable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"verlprobe{uuid.uuid4().hex[:6]}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"`ip netns add` is not permitted here: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class TwoNamespaces:
    """ns A (10.77.0.1) and ns B (10.77.0.2) joined by a veth pair; removed on exit."""

    def __init__(self):
        tag = uuid.uuid4().hex[:5]
        self.a, self.b = f"verlA{tag}", f"verlB{tag}"
        self.veth_a, self.veth_b = f"vva{tag}", f"vvb{tag}"

    def __enter__(self):
        try:
            _ip("netns", "add", self.a)
            _ip("netns", "add", self.b)
            _ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
            _ip("link", "set", self.veth_a, "netns", self.a)
            _ip("link", "set", self.veth_b, "netns", self.b)
            for ns, dev, addr in ((self.a, self.veth_a, ADDR_A), (self.b, self.veth_b, ADDR_B)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def exec(self, ns: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def kill_processes(self) -> None:
        """End exactly the processes living in our two namespaces (the Ray nodes this test started); never
        `ray stop`, which would end every Ray process on the machine."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 20
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.5)

    def pids(self) -> list[int]:
        out = []
        for ns in (self.a, self.b):
            res = _ip("netns", "pids", ns, check=False)
            out += [int(p) for p in res.stdout.split()]
        return out

    def __exit__(self, *exc):
        self.kill_processes()
        for ns in (self.a, self.b):  # deleting a namespace deletes its end of the veth pair, and so the pair
            _ip("netns", "del", ns, check=False)


@pytest.fixture
def two_nodes():
    reason = _netns_usable()
    if reason and os.environ.get("VERL_REQUIRE_NETNS") == "1":
        pytest.fail(f"VERL_REQUIRE_NETNS=1 but this test cannot run: {reason}. Run it as root (or with "
                    "CAP_NET_ADMIN) with iproute2 installed, or unset VERL_REQUIRE_NETNS to allow the skip.")
    if reason:
        pytest.skip(reason)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)
    temp = f"/tmp/ray_mn_{uuid.uuid4().hex[:6]}"
    # One CPU per node and one CPU per worker: the two ranks cannot share a node.
    common = ["--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]
    with TwoNamespaces() as nets:
        try:
            for ns, args in ((nets.a, ["--head", f"--node-ip-address={ADDR_A}", f"--port={RAY_PORT}",
                                       f"--temp-dir={temp}", "--include-dashboard=false"]),
                             (nets.b, [f"--address={ADDR_A}:{RAY_PORT}", f"--node-ip-address={ADDR_B}"])):
                res = subprocess.run(nets.exec(ns, [ray_bin, "start", *args, *common]), env=env,
                                     capture_output=True, text=True, timeout=120)
                assert res.returncode == 0, f"ray start in {ns} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
            yield nets, env
        finally:
            nets.kill_processes()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow  # about 2.5 minutes: two Ray node start-ups plus the demo
def test_two_grpo_steps_on_two_ray_nodes(two_nodes, tmp_path):
    nets, env = two_nodes
    log = tmp_path / "metrics.jsonl"
    env = dict(env, RAY_ADDRESS=f"{ADDR_A}:{RAY_PORT}", VERL_DEMO_DIR=demo_dir(), VERL_FILE_LOGGER_PATH=str(log),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", "demo", "trainer.nnodes=2",
           "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
           # two data-parallel ranks halve the demo's per-GPU mini-batch (64 -> 32), so its micro-batch must halve too
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "trainer.val_before_train=false",
           "trainer.test_freq=-1", "trainer.logger=[console,file]", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]
    proc = subprocess.run(nets.exec(nets.a, cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [r for r in steps if "critic/score/mean" in r["data"]]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["data"]["response_length/mean"] > 0 for r in steps)
    # Ray prefixes the logs of workers on other nodes with their address: rank 1 really ran on node B.
    assert f"ip={ADDR_B}" in proc.stdout + proc.stderr
