"""Fixtures shared by the weight-sync tests: a one-rank gloo process group."""

import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def gloo_group():
    """World size 1, file:// rendezvous (no ports), shared by the whole session."""
    if dist.is_initialized():
        yield
        return
    fd, path = tempfile.mkstemp(prefix="verl_ws_pg_")
    os.close(fd)
    os.remove(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
