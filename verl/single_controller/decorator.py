"""`register(dispatch_mode=...)`: how a worker method's arguments are split across ranks and results joined.

A worker class marks its public methods; a worker group (Ray or local) reads the marks and builds one
callable per method on the group, so the controller calls ``wg.update_actor(batch)`` as if it were local.
"""

from __future__ import annotations

from enum import Enum
from functools import wraps

import torch

MAGIC_ATTR = "_verl_dispatch"


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"  # same arguments to every rank, list of results back
    ALL_TO_ALL = "all_to_all"  # caller passes per-rank lists, list of results back
    RANK_ZERO = "rank_zero"  # only rank 0 runs; its result back
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProto split by data-parallel rank, outputs concatenated
    DP_COMPUTE_METRIC = "dp_compute_metric"  # DataProto split by rank, list of per-rank results back


class Execute(str, Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


def register(dispatch_mode: Dispatch = Dispatch.ALL_TO_ALL, execute_mode: Execute = Execute.ALL, blocking: bool = True):
    def decorator(fn):
        @wraps(fn)
        def inner(*args, **kwargs):
            # A named range in any running torch.profiler trace (scripts/trace_top_kernels.py --window splits a
            # step's trace by role call); without a profiler this costs about a microsecond per call.
            with torch.profiler.record_function(f"verl::{fn.__name__}"):
                return fn(*args, **kwargs)

        setattr(inner, MAGIC_ATTR, {"dispatch_mode": Dispatch(dispatch_mode), "execute_mode": Execute(execute_mode),
                                     "blocking": blocking})
        return inner

    return decorator


def registered_methods(cls) -> dict[str, dict]:
    """Names of the methods of ``cls`` marked with :func:`register`, with their dispatch settings."""
    out = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        attr = getattr(cls, name, None)
        if callable(attr) and hasattr(attr, MAGIC_ATTR):
            out[name] = getattr(attr, MAGIC_ATTR)
    return out
