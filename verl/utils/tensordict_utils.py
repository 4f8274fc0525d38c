"""Helpers over ``tensordict.TensorDict`` batches (verl's "protocol v2" data container).

A batch is a TensorDict with ``batch_size=[B]`` whose entries are
 * dense tensors ``(B, ...)``,
 * jagged nested tensors (``torch.nested``, ``layout=torch.jagged``), e.g.
   unpadded ``input_ids`` ``(B, j)`` or Qwen3.5 mRoPE ``position_ids`` ``(B, 3|4, j)``,
 * ``NonTensorStack`` (one Python object per sample) and ``NonTensorData``
   (one object for the whole batch, i.e. meta info).

TensorDict's own chunk/index/cat do not handle jagged fields reliably, so the
functions here treat them explicitly: split into per-sample tensors, regroup,
and re-nest with the ragged dimension preserved.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np
import torch
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

from verl.utils.py_functional import CheckError

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- non-tensor values


def assign_non_tensor_data(tensor_dict: TensorDict, key: str, val: Any) -> None:
    """Store one batch-level Python value under ``key``."""
    _require_td(tensor_dict)
    tensor_dict[key] = NonTensorData(val)


def assign_non_tensor_stack(tensor_dict: TensorDict, key: str, val: list) -> None:
    """Store one Python object per sample (lists, dicts, nested structures) under ``key``."""
    _require_td(tensor_dict)
    tensor_dict[key] = NonTensorStack.from_list([NonTensorData(item) for item in val])


def assign_non_tensor(tensor_dict: TensorDict, **kwargs) -> TensorDict:
    """Assign each keyword: lists become per-sample stacks, anything else batch-level data."""
    _require_td(tensor_dict)
    for key, val in kwargs.items():
        if isinstance(val, NonTensorData | NonTensorStack):
            tensor_dict[key] = val
        elif isinstance(val, list):
            assign_non_tensor_stack(tensor_dict, key, val)
        else:
            assign_non_tensor_data(tensor_dict, key, val)
    return tensor_dict


def unwrap_non_tensor_data(data: Any) -> Any:
    """``NonTensorData(x) -> x``; anything else unchanged."""
    return data.data if isinstance(data, NonTensorData) else data


def get_non_tensor_data(data: TensorDict, key: str, default: Any) -> Any:
    """``data[key]`` unwrapped, or ``default`` when absent."""
    return unwrap_non_tensor_data(data.get(key, default))


def _require_td(obj: Any) -> None:
    if not isinstance(obj, TensorDict):
        raise CheckError(f"input dict must be a TensorDict, got {type(obj).__name__}")


def _native(value: Any) -> Any:
    # Tensor -> tensor, per-sample stack -> list, batch-level data -> the object.
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return value.data
    return value


def get(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """Value of ``key`` in native form (tensor / list / object), or ``default``."""
    if key not in tensordict.keys():
        return default
    return _native(tensordict.get(key))


def pop(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """Remove ``key`` and return it in native form, or ``default`` when absent."""
    if key not in tensordict.keys():
        return default
    return _native(tensordict.pop(key))


def _collect_keys(tensordict: TensorDict, keys: Iterable[str], remove: bool) -> TensorDict:
    per_sample, batch_level = {}, {}
    for key in keys:
        if key not in tensordict.keys():
            raise KeyError(f"key {key} not in tensordict (available: {sorted(tensordict.keys())})")
        value = tensordict.pop(key) if remove else tensordict.get(key)
        if isinstance(value, NonTensorData):
            batch_level[key] = value.data
        else:
            per_sample[key] = value.tolist() if isinstance(value, NonTensorStack) else value
    return get_tensordict(per_sample, batch_level)


def get_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """New TensorDict holding only ``keys`` (KeyError for a missing one)."""
    return _collect_keys(tensordict, keys, remove=False)


def pop_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """Move ``keys`` out of ``tensordict`` into a new TensorDict (KeyError for a missing one)."""
    return _collect_keys(tensordict, keys, remove=True)


def get_tensordict(tensor_dict: dict[str, Any], non_tensor_dict: dict | None = None) -> TensorDict:
    """Build a batch TensorDict.

    ``tensor_dict`` values (all of the same length B) may be tensors, jagged nested
    tensors, lists / numpy arrays of Python objects (stored per sample) or
    ``NonTensorStack``. ``non_tensor_dict`` entries become batch-level data.
    """
    source: dict[str, Any] = {}
    batch_size = None
    for key, val in tensor_dict.items():
        if isinstance(val, torch.Tensor):
            if val.is_nested and (val.layout != torch.jagged or not val.is_contiguous()):
                raise CheckError(f"nested tensor '{key}' must be a contiguous torch.jagged tensor")
            length = val.shape[0]
            source[key] = val
        elif isinstance(val, NonTensorStack):
            length = len(val)
            source[key] = val
        elif isinstance(val, list | np.ndarray):
            if any(isinstance(item, torch.Tensor) for item in val):
                raise CheckError(
                    f"'{key}' is a list holding torch.Tensors; stack them into one tensor (or a nested tensor), "
                    "or convert the items to numpy first"
                )
            length = len(val)
            source[key] = NonTensorStack.from_list([NonTensorData(item) for item in val])
        else:
            raise CheckError(f"{key} -> {type(val).__name__} isn't of 'torch.Tensor | list | np.ndarray' type")
        if batch_size is None:
            batch_size = length
        elif length != batch_size:
            raise CheckError(f"Batch size of {key} is {length}, inconsistent with the other entries ({batch_size})")
    for key, val in (non_tensor_dict or {}).items():
        if key in source:
            raise CheckError(f"'{key}' is given both as per-sample data and as batch-level data")
        source[key] = val if isinstance(val, NonTensorData) else NonTensorData(val)
    return TensorDict(source, batch_size=[] if batch_size is None else [batch_size])


def list_of_dict_to_tensordict(list_of_dicts: list[dict[str, Any]]) -> TensorDict:
    """One dict per sample -> batch TensorDict (stack / jagged-nest tensors, stack other objects)."""
    if not list_of_dicts:
        raise CheckError("list_of_dicts is empty; need at least one sample")
    fields = {}
    for key in list_of_dicts[0]:
        column = [sample[key] for sample in list_of_dicts]
        if all(isinstance(item, torch.Tensor) for item in column):
            same_shape = all(item.shape == column[0].shape for item in column)
            fields[key] = torch.stack(column) if same_shape else nested_tensor_from_tensor_list(column)
        else:
            fields[key] = NonTensorStack(*column)
    return TensorDict(fields, batch_size=[len(list_of_dicts)])


# ----------------------------------------------------------------------------- jagged tensors


def _ragged_dim(nt: torch.Tensor) -> int:
    """Dimension index (counting the batch dim) that is ragged in a jagged tensor."""
    return getattr(nt, "_ragged_idx", 1)


def nested_tensor_from_tensor_list(tensors: list[torch.Tensor], ragged_idx: int | None = None) -> torch.Tensor:
    """Jagged nested tensor from per-sample tensors, ragged along ``ragged_idx`` (1-based: counts the batch dim).

    Defaults to the last dim of the samples. Unlike ``as_nested_tensor`` this keeps
    the requested ragged dim even when every sample happens to have the same
    length, and it records min/max lengths (PyTorch's ``to_padded_tensor`` pads
    to a wrong width when these are missing for non-leading ragged dims).
    """
    if len(tensors) == 0:
        raise CheckError("Must provide at least one tensor to build a nested tensor")
    sample_dims = tensors[0].dim()
    if ragged_idx is None:
        ragged_idx = sample_dims
    if not 1 <= ragged_idx <= sample_dims:
        raise CheckError(f"ragged_idx must be in [1, {sample_dims}] for {sample_dims}-D samples, got {ragged_idx}")
    cat_dim = ragged_idx - 1
    lengths = torch.tensor([t.shape[cat_dim] for t in tensors], dtype=torch.long)
    offsets = torch.zeros(len(tensors) + 1, dtype=torch.long)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    values = torch.cat(list(tensors), dim=cat_dim)
    return torch.nested.nested_tensor_from_jagged(
        values,
        offsets=offsets.to(values.device),
        jagged_dim=ragged_idx,
        min_seqlen=int(lengths.min()),
        max_seqlen=int(lengths.max()),
    )


def _split_by_padding(nt: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample views of a jagged tensor via a padded copy (fallback when ``unbind`` fails)."""
    ragged = _ragged_dim(nt)
    offsets = nt.offsets()
    lengths = nt.lengths() if nt.lengths() is not None else offsets.diff()
    lengths = lengths.tolist()
    # Re-wrap with explicit max length: a missing cached max makes to_padded_tensor truncate.
    rebuilt = torch.nested.nested_tensor_from_jagged(
        nt.values(), offsets=offsets, jagged_dim=ragged, min_seqlen=min(lengths), max_seqlen=max(lengths)
    )
    padded = rebuilt.to_padded_tensor(0)
    return [padded[i].narrow(ragged - 1, 0, n) for i, n in enumerate(lengths)]


def unbind_nested(nt: torch.Tensor) -> list[torch.Tensor]:
    """Split a jagged nested tensor into its per-sample tensors.

    ``unbind`` is used when it works; some PyTorch versions fail to unbind 3-D
    jagged tensors such as mRoPE position ids ``(B, 3, j)`` (pytorch#153238), in
    which case the tensor is padded and each sample cut back to its length.
    """
    try:
        return list(nt.unbind(0))
    except RuntimeError as exc:
        logger.debug("unbind failed on a %s jagged tensor (%s); using the padding fallback", tuple(nt.shape), exc)
        return _split_by_padding(nt)


def concat_nested_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate jagged nested tensors along the batch dim."""
    for t in tensors:
        if not t.is_nested or t.dim() < 2:
            raise CheckError(f"expected jagged nested tensors with >= 2 dims, got shape {tuple(t.shape)}")
    samples = [sample for t in tensors for sample in unbind_nested(t)]
    return nested_tensor_from_tensor_list(samples, ragged_idx=_ragged_dim(tensors[0]))


def _nested_keys(td: TensorDict) -> set[str]:
    return {k for k, v in td.items() if isinstance(v, torch.Tensor) and v.is_nested}


def _without(td: TensorDict, keys: set[str]) -> TensorDict:
    return TensorDict({k: v for k, v in td.items() if k not in keys}, batch_size=td.batch_size, device=td.device)


# ----------------------------------------------------------------------------- batch ops


def concat_tensordict(data: list[TensorDict]) -> TensorDict:
    """Concatenate batches along dim 0 (jagged fields included).

    Batch-less TensorDicts (meta info only) are not concatenated: the first is returned.
    """
    if len(data) == 0:
        raise CheckError("Must have at least one tensordict to concatenate")
    if len(data[0].batch_size) == 0:
        if any(len(d.batch_size) != 0 for d in data):
            raise CheckError("cannot concatenate batch-less TensorDicts with batched ones")
        return data[0]
    nested = _nested_keys(data[0])
    for position, td in enumerate(data):
        if _nested_keys(td) != nested:
            raise CheckError(
                f"All tensordicts must have the same set of nested tensors: element 0 has {sorted(nested)}, "
                f"element {position} has {sorted(_nested_keys(td))}"
            )
    # Batch-level values are not stacked per row: the first part's value wins (recent
    # tensordict versions would otherwise turn them into a per-row list).
    batch_level = {k: v for k, v in data[0].items() if isinstance(v, NonTensorData)}
    skip = nested | set(batch_level)
    output = TensorDict.cat([_without(td, skip) for td in data], dim=0)
    for key in nested:
        output[key] = concat_nested_tensors([td[key] for td in data])
    for key, value in batch_level.items():
        output[key] = NonTensorData(value.data)
    return output


def chunk_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    """Split ``td`` into ``chunks`` equal parts along dim 0, jagged fields included."""
    if not isinstance(td, TensorDict):
        raise CheckError(f"expected a TensorDict, got {type(td).__name__}")
    if chunks <= 0 or len(td) % chunks != 0:
        raise CheckError(
            f"expecting td with length divisible by chunks, but got {len(td)} and {chunks}; "
            "pad the batch (pad_to_divisor) or pick a divisor"
        )
    size = len(td) // chunks
    nested = _nested_keys(td)
    parts = list(_without(td, nested).split(size, dim=0)) if len(td) else [_without(td, nested)] * chunks
    for key in nested:
        nt = td[key]
        samples = unbind_nested(nt)
        for i, part in enumerate(parts):
            part[key] = nested_tensor_from_tensor_list(samples[i * size : (i + 1) * size], ragged_idx=_ragged_dim(nt))
    return parts


def index_select_tensor_dict(batch: TensorDict | None, indices: torch.Tensor | list[int]) -> TensorDict | None:
    """Rows ``indices`` (1-D) of ``batch``; batch-level data is kept as is."""
    if batch is None:
        return None
    indices = torch.as_tensor(indices, dtype=torch.long) if not isinstance(indices, torch.Tensor) else indices
    if indices.dim() != 1:
        raise CheckError(f"indices must be a 1D tensor, got shape {tuple(indices.shape)}")
    picked: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            samples = unbind_nested(value)
            picked[key] = nested_tensor_from_tensor_list([samples[int(i)] for i in indices], _ragged_dim(value))
        elif isinstance(value, torch.Tensor) or (hasattr(value, "shape") and len(value.shape) > 0):
            picked[key] = value[indices]
        else:  # batch-level NonTensorData
            picked[key] = value
    return TensorDict(picked, batch_size=[indices.shape[0]])


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` in place; shared keys must hold equal values."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise CheckError(
            f"Two tensor dict must have identical batch size. Got {tensor_dict1.batch_size} and "
            f"{tensor_dict2.batch_size}"
        )
    for key in tensor_dict2.keys():
        incoming = tensor_dict2.get(key)
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = incoming
            continue
        current = tensor_dict1.get(key)
        if isinstance(incoming, torch.Tensor):
            same = _tensors_equal(current, incoming)
        else:
            same = _native(current) == _native(incoming)
        if not same:
            raise CheckError(f"{key} in tensor_dict1 and tensor_dict2 are not the same object (values differ)")
    return tensor_dict1


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_nested or b.is_nested:
        if not (a.is_nested and b.is_nested):
            return False
        xs, ys = unbind_nested(a), unbind_nested(b)
        return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))
    return a.shape == b.shape and torch.equal(a, b)


def assert_tensordict_eq(tensordict1: TensorDict, tensordict2: TensorDict) -> None:
    """Raise AssertionError describing the first difference between two TensorDicts."""
    keys1, keys2 = set(tensordict1.keys()), set(tensordict2.keys())
    assert keys1 == keys2, f"key set diffs: {sorted(keys1 ^ keys2)}"
    for key in keys1:
        a, b = tensordict1.get(key), tensordict2.get(key)
        assert type(a) is type(b), f"The type of {key} must be the same. Got {type(a)} vs {type(b)}"
        if isinstance(a, torch.Tensor):
            assert _tensors_equal(a, b), f"values of {key} differ"
        else:
            assert _native(a) == _native(b), f"values of {key} differ"


def make_iterator(tensordict: TensorDict, mini_batch_size: int, epochs: int, seed=None, dataloader_kwargs=None):
    """Yield mini-batch TensorDicts for ``epochs`` passes (``dataloader_kwargs`` e.g. ``{"shuffle": True}``)."""
    from torch.utils.data import DataLoader

    if mini_batch_size <= 0 or tensordict.batch_size[0] % mini_batch_size != 0:
        raise CheckError(
            f"{tensordict.batch_size[0]} % {mini_batch_size} != 0: mini_batch_size must divide the batch size"
        )
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = DataLoader(
        torch.arange(tensordict.batch_size[0]),
        batch_size=mini_batch_size,
        collate_fn=torch.stack,
        generator=generator,
        **(dataloader_kwargs or {}),
    )

    return (index_select_tensor_dict(tensordict, rows) for _ in range(epochs) for rows in loader)


def pad_to_divisor(data: TensorDict, size_divisor: int):
    """Append copies of leading rows until ``len`` divides ``size_divisor``; returns (padded, pad_size)."""
    _require_td(data)
    pad_size = (-len(data)) % size_divisor
    if pad_size == 0 or len(data) == 0:
        if len(data) == 0:
            logger.warning("padding an empty TensorDict; nothing to repeat, no change made")
        return data, 0
    repeats = [data[: min(pad_size - done, len(data))] for done in range(0, pad_size, len(data))]
    return concat_tensordict([data, *repeats]), pad_size


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    """Drop the last ``pad_size`` rows (undo :func:`pad_to_divisor`)."""
    return data[:-pad_size] if pad_size else data


def contiguous(data: TensorDict) -> TensorDict:
    """A new TensorDict with contiguous tensors (non-tensor entries passed through unchanged)."""
    entries = {key: data.get(key) for key in data.keys()}
    bad = [k for k, v in entries.items() if not isinstance(v, torch.Tensor | NonTensorData | NonTensorStack)]
    if bad:
        raise CheckError(f"unexpected entries {bad} in TensorDict: expected tensors or non-tensor data")
    batch_level = {k: v for k, v in entries.items() if isinstance(v, NonTensorData)}
    per_sample = {
        k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in entries.items() if k not in batch_level
    }
    return get_tensordict(per_sample, batch_level)


def maybe_fix_3d_position_ids(data: TensorDict) -> None:
    """Restore ragged dim 2 on 3-D jagged ``position_ids`` if a serialisation round trip lost it."""
    pos = data.get("position_ids", None)
    if isinstance(pos, torch.Tensor) and pos.is_nested and pos.dim() == 3 and _ragged_dim(pos) != 2:
        pos._ragged_idx = 2


# ----------------------------------------------------------------------------- numpy wire format
# A torch-free encoding (dtype name, shape, raw bytes) used when
# VERL_DATAPROTO_SERIALIZATION_METHOD=numpy; jagged fields travel as per-sample lists.


def serialize_single_tensor(obj: torch.Tensor):
    """``(dtype name, shape, uint8 numpy buffer)`` of a dense tensor."""
    raw = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return str(obj.dtype).replace("torch.", ""), tuple(obj.shape), raw


def deserialize_single_tensor(arr) -> torch.Tensor:
    dtype_name, shape, raw = arr
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckError(f"unknown tensor dtype '{dtype_name}' in serialized data")
    buffer = bytearray(raw)  # writable copy: frombuffer on read-only memory warns
    if len(buffer) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def serialize_tensordict(batch: TensorDict):
    """``(batch_size, device, {key: encoded})``; jagged tensors encode as ``(layout, [samples])``."""
    items = {}
    for key, value in batch.items():
        if value.is_nested:
            layout = str(value.layout).replace("torch.", "")
            items[key] = (layout, [serialize_single_tensor(t) for t in unbind_nested(value)])
        else:
            items[key] = serialize_single_tensor(value)
    device = None if batch.device is None else str(batch.device)
    return tuple(batch.batch_size), device, items


def deserialize_tensordict(arr) -> TensorDict:
    batch_size, device, items = arr
    decoded = {}
    for key, value in items.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout_name, samples = value
            decoded[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(s) for s in samples], layout=getattr(torch, layout_name)
            )
        else:
            raise CheckError(f"Invalid tensor encoding format for '{key}': expected length 2 or 3, got {len(value)}")
    return TensorDict(decoded, batch_size=batch_size, device=device)
