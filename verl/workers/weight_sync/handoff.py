"""Full weights handed from the trainer pool to a rollout pool of its own (the asynchronous modes), through Ray's
shared-memory object store once.

Returning ``[(name, tensor), ...]`` from the trainer's worker and passing it on to the rollout workers pickles
every tensor into the object store and out of it twice (worker -> controller -> each rollout rank): on 2 x H200
(2026-11-27) handing over the 0.8B shape's 1.5 GB took about 10 s of a 30 s fully-async trainer step.

Here the trainer's rank copies each tensor to the host as raw bytes (a numpy array: Ray stores those out of band,
without pickling their contents), puts the list into the object store itself and hands the controller a small
:class:`WeightPackage` (names, dtypes, shapes and the object's reference). Each rollout rank maps the arrays
read-only from shared memory (not copied out of the store) and copies each one to its device. The tensors are
produced one at a time, so the trainer's device never holds more than the engine's own export buffers.

Without Ray (a worker called in-process, tests) the package carries the arrays themselves.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch


@dataclass
class WeightPackage:
    """What the controller forwards: ``(name, dtype, shape)`` per tensor and their bytes (a Ray ``ObjectRef`` to
    a list of uint8 numpy arrays, or the list itself)."""

    entries: list[tuple[str, torch.dtype, tuple[int, ...]]]
    nbytes: int
    arrays: Any

    def __len__(self) -> int:
        return len(self.entries)


def _ray_is_up() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A host copy of the tensor's bytes (numpy has no bfloat16: every dtype travels as uint8). Always a copy: an
    engine may hand out views of a reused export buffer or of its live parameters."""
    host = t.detach().to("cpu", copy=True).contiguous().reshape(-1)
    return host.view(torch.uint8).numpy()


def pack(weights: Iterable[tuple[str, torch.Tensor]], use_object_store: bool | None = None) -> WeightPackage:
    """``weights`` (any device, consumed one at a time) -> a package; inside Ray the bytes go into the object
    store once, by this process."""
    entries, arrays, nbytes = [], [], 0
    for name, t in weights:
        entries.append((name, t.dtype, tuple(t.shape)))
        arrays.append(_as_bytes(t))
        nbytes += arrays[-1].nbytes
    if _ray_is_up() if use_object_store is None else use_object_store:
        import ray

        return WeightPackage(entries, nbytes, ray.put(arrays))
    return WeightPackage(entries, nbytes, arrays)


def unpack(package: WeightPackage | list, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor on device)`` one at a time (the receiving device never holds more than one extra tensor),
    each a fresh copy: the store's shared memory is read-only, and a weight loader downstream may transpose or
    cast in place. A plain ``[(name, tensor)]`` list passes through."""
    if not isinstance(package, WeightPackage):
        yield from package
        return
    arrays = package.arrays
    if not isinstance(arrays, list):
        import ray

        arrays = ray.get(arrays)
    device = torch.device(device)
    for (name, dtype, shape), raw in zip(package.entries, arrays):
        if raw.size == 0:  # an empty tensor's array has no strides to view through
            yield name, torch.empty(shape, dtype=dtype, device=device)
            continue
        with warnings.catch_warnings():
            # a view of the read-only store array, read once by the copy
            warnings.filterwarnings("ignore", message=".*not writable.*")
            raw_t = torch.from_numpy(raw)
        yield name, raw_t.to(device, copy=True).view(dtype).view(shape)
