"""Ray-side companions of :class:`~verl.protocol.DataProto`: ``DataProtoFuture`` (unresolved worker outputs)
and ``BatchData`` (chunk / concat by type, for dispatch code).

Split from ``verl/protocol.py`` (which re-exports both names) along the line between the batch container and
the transport around it. ``verl.protocol`` imports this module to re-export its names, so this module never
imports ``verl.protocol``: it knows a ``DataProto`` by its class (:func:`_is_dataproto`) and concatenates
through the class's own ``concat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tensordict import TensorDict

from verl.utils import tensordict_utils as tu

__all__ = ["BatchData", "DataProtoFuture"]


def _is_dataproto(obj) -> bool:
    return any(c.__name__ == "DataProto" and c.__module__ == "verl.protocol" for c in type(obj).__mro__)


def _concat_outputs(outputs: list):
    """DataProto outputs via ``DataProto.concat``, TensorDicts via tensordict_utils; nothing else."""
    if outputs and all(_is_dataproto(o) for o in outputs):
        return type(outputs[0]).concat(outputs)
    if outputs and all(isinstance(o, TensorDict) for o in outputs):
        return tu.concat_tensordict(outputs)
    kinds = [type(o).__name__ for o in outputs]
    raise TypeError(f"DataProtoFuture expects DataProto or TensorDict results, got {kinds}")


@dataclass
class DataProtoFuture:
    """Unresolved worker outputs: ``get()`` fetches ``futures`` with Ray, collects, then dispatches.

    Lets the driver pass one worker group's output to another without materialising it.
    """

    collect_fn: Callable
    futures: list
    dispatch_fn: Callable = None

    @staticmethod
    def concat(data: list) -> "DataProtoFuture":
        return DataProtoFuture(collect_fn=_concat_outputs, futures=data)

    def chunk(self, chunks: int) -> list["DataProtoFuture"]:
        from functools import partial

        return [
            DataProtoFuture(self.collect_fn, self.futures, dispatch_fn=partial(_pick_chunk, i, chunks))
            for i in range(chunks)
        ]

    def get(self):
        import ray

        merged = _concat_outputs(ray.get(self.futures))
        return self.dispatch_fn(merged) if self.dispatch_fn is not None else merged


def _pick_chunk(index: int, chunks: int, data):
    # Module-level (not a closure) so the dispatch function pickles.
    if isinstance(data, TensorDict):
        return tu.chunk_tensordict(data, chunks)[index]
    return data.chunk(chunks=chunks)[index]


class BatchData:
    """Type-dispatching wrapper so dispatch code can chunk/concat without isinstance ladders.

    Handles DataProto, DataProtoFuture, TensorDict and lists of Ray ObjectRefs.
    """

    def __init__(self, data):
        self._data = data

    def is_chunkable(self) -> bool:
        return _is_dataproto(self._data) or isinstance(self._data, DataProtoFuture | TensorDict)

    def is_concatable(self) -> bool:
        data = self._data
        if not isinstance(data, list | tuple) or not data:
            return False
        return _is_dataproto(data[0]) or isinstance(data[0], TensorDict) or _is_object_ref(data[0])

    def chunk(self, chunks: int):
        if isinstance(self._data, TensorDict):
            return tuple(tu.chunk_tensordict(self._data, chunks))
        return self._data.chunk(chunks=chunks)

    def concat(self):
        data = self._data
        if not data:
            raise ValueError("Cannot concatenate an empty list of data items.")
        if _is_object_ref(data[0]):
            return DataProtoFuture.concat(list(data))
        if isinstance(data[0], TensorDict):
            return tu.concat_tensordict(list(data))
        return type(data[0]).concat(list(data))


def _is_object_ref(obj) -> bool:
    return type(obj).__name__ == "ObjectRef" and type(obj).__module__.startswith("ray")
