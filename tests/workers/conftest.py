"""Fixtures shared by the worker and engine tests."""

import pytest

from tests.engine_utils import single_rank_gloo


@pytest.fixture(scope="module")
def gloo():
    """A one-rank gloo process group for the module (FSDP2 engines need one even on one CPU process)."""
    with single_rank_gloo():
        yield
