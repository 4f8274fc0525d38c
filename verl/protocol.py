"""``DataProto``: the batch container passed between the driver and worker groups.

A DataProto holds
 * ``batch``: a ``TensorDict`` with ``batch_size=[N]`` (token ids, masks, log-probs, ...),
 * ``non_tensor_batch``: ``{name: numpy object array of length N}`` (raw prompts, uids, ...),
 * ``meta_info``: a plain dict for the whole batch (temperature, metrics, ...).

Ray ships DataProtos between processes, so pickling packs the TensorDict into
one consolidated ``torch.save`` buffer (or raw numpy bytes when
``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``). Ray itself is imported lazily.
"""

from __future__ import annotations

import copy
import io
import logging
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import tensordict
import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import CheckError, deep_equal, describe_type, list_of_dict_to_dict_of_list, union_two_dict
from verl.utils.tensordict_utils import deserialize_single_tensor, deserialize_tensordict  # noqa: F401 (re-export)
from verl.utils.tensordict_utils import serialize_single_tensor, serialize_tensordict  # noqa: F401 (re-export)
from verl.utils.torch_functional import all_gather_data_proto  # noqa: F401 (re-export)

__all__ = [
    "DataProto", "DataProtoItem", "DataProtoFuture", "DataProtoConfig", "BatchData", "union_tensor_dict",
    "union_numpy_dict", "pad_dataproto_to_divisor", "unpad_dataproto", "fold_batch_dim", "unfold_batch_dim",
    "collate_fn", "all_gather_data_proto",
]  # fmt: skip

logger = logging.getLogger(__name__)

try:  # keep TensorDict from wrapping lists into lazy stacks (older tensordict defaults differ)
    tensordict.set_lazy_legacy(False).set()
except Exception:
    pass


class _AutoPaddingSwitch(type):
    """Class-level ``DataProtoConfig.auto_padding`` flag, also switchable with VERL_AUTO_PADDING=1."""

    auto_padding_key = "_verl_auto_padding"
    _enabled = False

    @property
    def auto_padding(cls) -> bool:
        return cls._enabled or os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise CheckError(f"auto_padding must be a bool, got {enabled!r}")
        _AutoPaddingSwitch._enabled = enabled


class DataProtoConfig(metaclass=_AutoPaddingSwitch):
    """Global switches for DataProto (currently: ``DataProtoConfig.auto_padding``)."""


# ----------------------------------------------------------------------------- module helpers


def pad_dataproto_to_divisor(data: "DataProto", size_divisor: int):
    """Repeat leading rows so ``len(data)`` becomes a multiple of ``size_divisor``.

    Returns ``(padded, pad_size)``; undo with :func:`unpad_dataproto`.
    """
    if not isinstance(data, DataProto):
        raise CheckError(f"data must be a DataProto, got {type(data).__name__}")
    if size_divisor <= 0:
        raise CheckError(f"size_divisor must be positive, got {size_divisor}")
    pad_size = (-len(data)) % size_divisor
    if len(data) == 0:
        logger.warning("padding a DataProto with no item, no changed made")
        return data, 0
    if pad_size == 0:
        return data, 0
    fillers = [data[: min(len(data), pad_size - done)] for done in range(0, pad_size, len(data))]
    return DataProto.concat([data, *fillers]), pad_size


def unpad_dataproto(data: "DataProto", pad_size: int) -> "DataProto":
    """Drop the ``pad_size`` rows added by :func:`pad_dataproto_to_divisor`."""
    return data[:-pad_size] if pad_size else data


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s entries to ``tensor_dict1`` in place; shared keys must be equal."""
    return tu.union_tensor_dict(tensor_dict1, tensor_dict2)


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` in place; shared keys must be deeply equal."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            if not isinstance(value, np.ndarray) or not isinstance(tensor_dict1[key], np.ndarray):
                raise CheckError(f"non_tensor_batch['{key}'] must be a numpy array on both sides")
            if not deep_equal(tensor_dict1[key], value):
                raise CheckError(f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object.")
        tensor_dict1[key] = value
    return tensor_dict1


def fold_batch_dim(data: "DataProto", new_batch_size: int) -> "DataProto":
    """Reshape the batch dim ``[N, ...]`` to ``[new_batch_size, N // new_batch_size, ...]``."""
    n = data.batch.batch_size[0]
    if n % new_batch_size != 0:
        raise CheckError(f"cannot fold batch of {n} into {new_batch_size} groups: not divisible")
    batch = data.batch.view(new_batch_size, -1)
    batch.auto_batch_size_(batch_dims=1)
    non_tensor = {k: np.reshape(v, (new_batch_size, -1, *v.shape[1:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: "DataProto", batch_dims: int = 2) -> "DataProto":
    """Merge the leading ``batch_dims`` dims back into a single batch dim (inverse of fold)."""
    batch = data.batch
    batch.auto_batch_size_(batch_dims=batch_dims)
    batch = batch.view(-1)
    n = batch.batch_size[0]
    non_tensor = {k: np.reshape(v, (n, *v.shape[batch_dims:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def collate_fn(x: list["DataProtoItem"]) -> "DataProto":
    """Stack a list of DataProtoItems back into a DataProto (used by ``make_iterator``)."""
    batch = torch.stack([item.batch for item in x]).contiguous()
    columns = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in x])
    non_tensor = {key: np.array(values, dtype=object) for key, values in columns.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensor)


def _as_object_array(values) -> np.ndarray:
    # Same rule as upstream: a list of equal-length lists becomes a 2-D object array.
    return values if isinstance(values, np.ndarray) else np.array(values, dtype=object)


@dataclass
class DataProtoItem:
    """One sample of a DataProto (``data[i]``): a batch-less TensorDict row plus that row's objects."""

    batch: Optional[TensorDict] = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    """Batch container: ``batch`` (TensorDict), ``non_tensor_batch`` (numpy dict), ``meta_info`` (dict)."""

    batch: Optional[TensorDict] = None  # None when the batch carries only non-tensor data
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.check_consistency()

    # -------------------------------------------------------------- size / indexing

    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return next(iter(self.non_tensor_batch.values())).shape[0]
        return 0

    def __getitem__(self, item):
        """int -> DataProtoItem; slice, index list/array/tensor or bool mask -> DataProto."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, list | np.ndarray | torch.Tensor):
            return self.select_idxs(item)
        if isinstance(item, int | np.integer):
            return DataProtoItem(
                batch=self.batch[item] if self.batch is not None else None,
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        raise TypeError(f"Indexing with {type(item)} is not supported; use an int, slice, or index/bool array")

    def check_consistency(self) -> None:
        """Validate shapes: one batch dim, numpy non-tensor columns of matching length."""
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise CheckError(f"only support num_batch_dims=1, got batch_size={list(self.batch.batch_size)}")
        expected = self.batch.batch_size[0] if self.batch is not None else None
        for key, value in (self.non_tensor_batch or {}).items():
            if not isinstance(value, np.ndarray):
                raise CheckError(
                    f"data in the non_tensor_batch must be a numpy.array with dtype=object, but for key={key!r} "
                    f"got {type(value).__name__}; wrap it with np.array(values, dtype=object)"
                )
            if expected is None:
                expected = value.shape[0]
            elif value.shape[0] != expected:
                raise CheckError(f"key {key} length {value.shape[0]} is not equal to batch size {expected}")

    # -------------------------------------------------------------- construction

    @classmethod
    def from_single_dict(cls, data: dict, meta_info: dict | None = None, auto_padding: bool = False):
        """Build from one dict, routing tensors to ``batch`` and numpy arrays to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise CheckError(
                    f"Unsupported type in data for key {key!r}: {type(value).__name__}; use torch.Tensor or np.ndarray"
                )
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding)

    @classmethod
    def from_dict(cls, tensors=None, non_tensors=None, meta_info=None, num_batch_dims=1, auto_padding=False):
        """Build from tensors sharing their first ``num_batch_dims`` dims (+ optional non-tensors/meta)."""
        if num_batch_dims <= 0:
            raise CheckError("num_batch_dims must be greater than zero")
        if non_tensors and num_batch_dims != 1:
            raise CheckError("only support num_batch_dims=1 when non_tensors is not None.")
        tensors = tensors or {}
        meta_info = {} if meta_info is None else meta_info
        if non_tensors is not None and not isinstance(non_tensors, dict):
            raise CheckError(f"non_tensors must be a dict, got {type(non_tensors).__name__}")
        non_tensors = {k: _as_object_array(v) for k, v in (non_tensors or {}).items()}
        batch_size, pivot = None, None
        for key, tensor in tensors.items():
            lead = tuple(tensor.shape[:num_batch_dims])
            if batch_size is None:
                batch_size, pivot = lead, key
            elif lead != batch_size:
                raise CheckError(
                    f"Not all the tensor in tensors have the same batch size with batch_dims={num_batch_dims}. "
                    f"Got {pivot} has {batch_size}, {key} has {lead}"
                )
        batch = TensorDict(tensors, batch_size=batch_size) if tensors else None
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict = None, meta_info=None, num_batch_dims=1):
        """Inverse of :meth:`to_tensordict`: tensors -> batch, stacks -> non_tensor_batch, data -> meta_info."""
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        meta_info = {} if meta_info is None else meta_info
        tensors, non_tensors = {}, {}
        for key, value in tensor_dict.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, NonTensorStack):
                non_tensors[key] = _as_object_array(value.tolist())
            elif isinstance(value, NonTensorData):
                meta_info[key] = value.data
        batch_size = next(iter(tensors.values())).shape[:num_batch_dims] if tensors else None
        batch = TensorDict(tensors, batch_size=batch_size) if tensors else None
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors, per-sample ``NonTensorStack`` columns and meta_info as NonTensorData."""
        tensors = self.batch.to_dict() if self.batch is not None else {}
        clash = set(tensors) & set(self.non_tensor_batch)
        if clash:
            raise CheckError(f"tensor_batch and non_tensor_batch have common keys {clash}; rename one side")
        for key, column in self.non_tensor_batch.items():
            tensors[key] = list(column)
        return tu.get_tensordict(tensor_dict=tensors, non_tensor_dict=self.meta_info)

    # -------------------------------------------------------------- serialisation

    def __getstate__(self):
        if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
            packed = serialize_tensordict(self.batch) if self.batch is not None else None
            return packed, self.non_tensor_batch, self.meta_info
        batch = self.batch
        if batch is not None and len(batch.keys()) > 0:
            batch = batch.contiguous().consolidate()  # one storage -> one buffer on the wire
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue(), self.non_tensor_batch, self.meta_info

    def __setstate__(self, state):
        packed, self.non_tensor_batch, self.meta_info = state
        if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
            self.batch = deserialize_tensordict(packed) if packed is not None else None
            return
        from verl.utils.device import is_device_available

        location = None if is_device_available() else "cpu"
        self.batch = torch.load(io.BytesIO(packed), weights_only=False, map_location=location)

    def save_to_disk(self, filepath) -> None:
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath) -> "DataProto":
        with open(filepath, "rb") as f:
            return pickle.load(f)

    def print_size(self, prefix: str = "") -> None:
        tensors = self.batch.values() if self.batch is not None else []
        tensor_gb = sum(t.element_size() * t.numel() for t in tensors) / 1024**3
        numpy_gb = sum(a.nbytes for a in self.non_tensor_batch.values()) / 1024**3
        message = f"Size of tensordict: {tensor_gb} GB, size of non_tensor_batch: {numpy_gb} GB"
        print(f"{prefix}, {message}" if prefix else message)

    def get_data_info(self) -> str:
        """Multi-line summary of keys, shapes, dtypes and meta_info value types."""
        lines = ["batch"]
        for key, tensor in (self.batch.items() if self.batch is not None else []):
            lines.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
        lines.append("non_tensor_batch")
        for key, array in self.non_tensor_batch.items():
            lines.append(f"  {key}: ndarray{array.shape} ({array.dtype})")
        lines.append("meta_info")
        for key, value in self.meta_info.items():
            lines.append(f"  {key}: {describe_type(value)}")
        return "\n".join(lines)

    # -------------------------------------------------------------- selection

    def to(self, device) -> "DataProto":
        """Move ``batch`` to ``device`` (in place); returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def select(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None, deepcopy=False):
        """Sub-DataProto with the given keys (None keeps everything of that part)."""
        batch = self.batch.select(*batch_keys) if batch_keys is not None else self.batch
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            non_tensor = {k: v for k, v in non_tensor.items() if k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {k: v for k, v in meta.items() if k in meta_info_keys}
        if deepcopy:
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def select_idxs(self, idxs) -> "DataProto":
        """Rows chosen by an index list/array/tensor or a boolean mask."""
        if isinstance(idxs, list):
            idxs = torch.tensor(idxs) if idxs else torch.zeros(0, dtype=torch.long)
        idx_np = idxs.detach().cpu().numpy() if isinstance(idxs, torch.Tensor) else np.asarray(idxs)
        if idx_np.dtype == bool:
            if idx_np.shape[0] != len(self):
                raise CheckError(f"boolean mask has length {idx_np.shape[0]}, DataProto has {len(self)} rows")
            idx_np = np.nonzero(idx_np)[0]
        idx_np = idx_np.astype(np.int64)
        batch = None
        if self.batch is not None:
            batch = tu.index_select_tensor_dict(self.batch, torch.from_numpy(idx_np))
            if self.batch.device is not None:
                batch = batch.to(self.batch.device)
        non_tensor = {k: v[idx_np] for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def slice(self, start=None, end=None, step=None) -> "DataProto":
        """``data[start:end:step]`` as a DataProto."""
        window = slice(start, end, step)
        batch = self.batch[window] if self.batch is not None else None
        non_tensor = {k: v[window] for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def pop(self, batch_keys=None, non_tensor_batch_keys=None, meta_info_keys=None) -> "DataProto":
        """Remove the given keys from self and return them as a new DataProto."""
        tensors = {k: self.batch.pop(k) for k in _existing(batch_keys, self.batch, "batch")}
        nt_keys = _existing(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor")
        non_tensors = {k: self.non_tensor_batch.pop(k) for k in nt_keys}
        meta = {k: self.meta_info.pop(k) for k in _existing(meta_info_keys, self.meta_info, "meta_info")}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)

    def rename(self, old_keys=None, new_keys=None) -> "DataProto":
        """Rename ``batch`` keys in place (only the tensor batch); returns self."""

        def as_list(keys):
            if isinstance(keys, str):
                return [keys]
            if isinstance(keys, list):
                return keys
            raise TypeError(f"keys must be a list or a string, but got {type(keys)}")

        sources, targets = as_list(old_keys), as_list(new_keys)
        if len(sources) != len(targets):
            raise ValueError(
                f"new_keys and old_keys must have the same length, but got {len(targets)} and {len(sources)}; "
                "give one new name per old name"
            )
        self.batch.rename_key_(tuple(sources), tuple(targets))
        return self

    def union(self, other: "DataProto") -> "DataProto":
        """Merge ``other`` into self (in place). Shared keys must hold equal values, else CheckError."""
        if self.batch is None:
            self.batch = other.batch
        elif other.batch is not None:
            self.batch = union_tensor_dict(self.batch, other.batch)
        self.non_tensor_batch = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        self.meta_info = union_two_dict(self.meta_info, other.meta_info)
        return self

    # -------------------------------------------------------------- splitting / joining

    def make_iterator(self, mini_batch_size, epochs, seed=None, dataloader_kwargs=None):
        """Iterate ``epochs`` times over mini-batch DataProtos of ``mini_batch_size`` rows."""
        from torch.utils.data import DataLoader

        if mini_batch_size <= 0 or len(self) % mini_batch_size != 0:
            raise CheckError(f"{len(self)} % {mini_batch_size} != 0: mini_batch_size must divide the batch size")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        loader = DataLoader(
            self, batch_size=mini_batch_size, collate_fn=collate_fn, generator=generator, **(dataloader_kwargs or {})
        )

        def batches():
            for _ in range(epochs):
                for mini in loader:
                    mini.meta_info = self.meta_info
                    yield mini

        return iter(batches())

    def is_padding_enabled(self) -> bool:
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first ("first") or last row, in place."""
        if padding_size == 0:
            return
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        padded = DataProto.concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` parts along dim 0; each part shares meta_info.

        Sizes must divide evenly unless auto padding is enabled (then parts differ by at most one row).
        """
        if chunks <= 0:
            raise CheckError(f"chunks must be positive, got {chunks}")
        if len(self) % chunks != 0 and not self.is_padding_enabled():
            raise CheckError(
                f"only support equal chunk. Got size of DataProto {len(self)} and chunk {chunks}; "
                "pad with pad_dataproto_to_divisor first"
            )
        bounds = np.cumsum([0] + [len(self) // chunks + (i < len(self) % chunks) for i in range(chunks)])
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(chunks)]

    def split(self, split_size: int) -> list["DataProto"]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size <= 0:
            raise CheckError(f"split_size must be positive, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list["DataProto"]) -> "DataProto":
        """Concatenate along dim 0 and merge meta_info.

        ``meta_info["metrics"]`` of all parts (a dict or a list of dicts each) is
        collected into one dict of lists; other keys shared by parts must agree.
        """
        if len(data) == 0:
            raise CheckError("DataProto.concat needs at least one DataProto")
        has_batch = [d.batch is not None for d in data]
        if any(has_batch) and not all(has_batch):
            raise CheckError("cannot concat DataProtos where only some have a tensor batch")
        batch = tu.concat_tensordict([d.batch for d in data]) if has_batch[0] else None
        columns = list_of_dict_to_dict_of_list([d.non_tensor_batch for d in data])
        non_tensor = {k: np.concatenate(v, axis=0) for k, v in columns.items()}

        meta, metrics = {}, []
        for part in data:
            for key, value in part.meta_info.items():
                if key == "metrics":
                    if value is not None:
                        metrics.extend(value if isinstance(value, list) else [value])
                elif key in meta and not deep_equal(meta[key], value):
                    raise CheckError(f"Conflicting values for meta_info key '{key}': {meta[key]!r} vs {value!r}")
                else:
                    meta.setdefault(key, value)
        if metrics:
            merged: dict[str, list] = {}
            for entry in metrics:
                if not isinstance(entry, dict):
                    raise CheckError(f"meta_info['metrics'] entries must be dicts, got {type(entry).__name__}")
                for name, value in entry.items():
                    merged.setdefault(name, []).append(value)
            meta["metrics"] = merged
        return type(data[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def reorder(self, indices: torch.Tensor) -> None:
        """Permute rows in place: row i becomes old row ``indices[i]``."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Repeat rows: interleave -> a,a,b,b ; otherwise -> a,b,a,b."""
        n = len(self)
        order = np.arange(n)
        order = np.repeat(order, repeat_times) if interleave else np.tile(order, repeat_times)
        return self.select_idxs(order)

    def sample_level_repeat(self, repeat_times) -> "DataProto":
        """Repeat row i ``repeat_times[i]`` times (kept adjacent)."""
        if isinstance(repeat_times, torch.Tensor | np.ndarray):
            if repeat_times.ndim != 1:
                raise CheckError("repeat_times must be 1-D")
            repeat_times = repeat_times.tolist()
        elif not isinstance(repeat_times, list | tuple):
            raise CheckError(
                f"repeat_times type must be in [list, torch.Tensor, np.ndarray, tuple], got {type(repeat_times)}"
            )
        if len(repeat_times) != len(self):
            raise CheckError(f"repeat_times has {len(repeat_times)} entries for {len(self)} rows")
        return self.select_idxs(np.repeat(np.arange(len(self)), list(repeat_times)))

    def unfold_column_chunks(self, n_split: int, split_keys: Optional[list[str]] = None) -> "DataProto":
        """Move ``n_split`` slices of dim 1 of ``split_keys`` into the batch dim; other keys are repeated."""
        split_keys = split_keys or []

        def unfold(value):
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        batch = None
        if self.batch is not None:
            fields = {
                k: unfold(v) if k in split_keys else torch.repeat_interleave(v, n_split, dim=0)
                for k, v in self.batch.items()
            }
            batch = TensorDict(fields, batch_size=(len(self) * n_split,), device=self.batch.device)
        non_tensor = {
            k: unfold(v) if k in split_keys else np.repeat(v, n_split, axis=0) for k, v in self.non_tensor_batch.items()
        }
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)


def _existing(keys, container, what: str) -> list:
    keys = list(keys or [])
    available = list(container.keys()) if container is not None else []
    for key in keys:
        if key not in available:
            raise CheckError(f"cannot pop {what} key {key!r}: not present (available: {available})")
    return keys


# Ray-side wrappers (futures of worker outputs, type-dispatching chunk/concat) live in their own module;
# imported last because they use DataProto, and re-exported so `from verl.protocol import ...` keeps working.
from verl.protocol_future import BatchData, DataProtoFuture  # noqa: E402
