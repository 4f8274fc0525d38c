"""Worker.ensure_process_group: a group of one (the local launcher, single-process SFT) binds no port."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import torch, torch.distributed as dist
from verl.single_controller.worker import Worker
Worker.ensure_process_group()
t = torch.ones(3)
dist.all_reduce(t)
g = dist.new_group([0])  # sub-groups (device meshes, Megatron's groups) build on the default store
dist.all_reduce(t, group=g)
print("ok", dist.get_world_size(), t.tolist())
"""


def test_a_group_of_one_needs_no_free_port():
    """MASTER_PORT names a port another process holds: a group of one still forms (env:// would fail with
    EADDRINUSE, as single-process SFT did once in CI when a parallel lane took its freshly chosen port)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy.getsockname()[1]))
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok 1 [1.0, 1.0, 1.0]" in out.stdout
