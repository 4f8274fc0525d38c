"""Stream the actor's weights as full HF-named tensors, a bounded bucket at a time.

The actor is an HF model, possibly wrapped by FSDP2 (parameters are ``DTensor`` shards), activation
checkpointing, ``torch.compile`` and PEFT. :func:`iter_hf_weights` turns it into ``(hf_name, full tensor)``
pairs without ever materialising more than one bucket (``bucket_megabytes``) or one decoder layer
(``layered=True``, the ``layered_summon`` setting) of gathered parameters at a time.

Every rank must drive the generator to the end in the same order: gathering a ``DTensor`` is a collective.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from .names import strip_wrapper_names

try:  # torch >= 2.4 public location
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    DTensor = ()

LORA_MODES = ("merged", "base", "adapter")
_LAYER_KEY = re.compile(r"^(.*?\.(?:layers|blocks)\.\d+)\.")
_ADAPTER_SEG = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.[^.]+(\.weight)?$")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole parameter: gathered across the mesh for a DTensor (a collective), itself otherwise."""
    if DTensor and isinstance(t, DTensor):
        return t.full_tensor()
    return t


@dataclass
class _Unit:
    """One output tensor: its HF name, the parameters it is computed from, and how."""

    name: str
    sources: list
    combine: Optional[Callable[[list[torch.Tensor]], torch.Tensor]] = None
    group: Optional[str] = None
    nbytes: int = field(default=0)

    def materialize(self, dtype: Optional[torch.dtype]) -> torch.Tensor:
        full = [full_tensor(s.detach()) for s in self.sources]
        out = self.combine(full) if self.combine is not None else full[0]
        if dtype is not None and out.is_floating_point():
            out = out.to(dtype)
        return out


def _lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """Clean module path -> PEFT LoRA layer, for every layer that wraps a ``base_layer``."""
    found = {}
    for path, sub in module.named_modules():
        if hasattr(sub, "base_layer") and hasattr(sub, "lora_A") and hasattr(sub, "scaling"):
            found[strip_wrapper_names(path)] = sub
    return found


def _merge_fn(layer: nn.Module, adapter: str) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    scaling = float(layer.scaling[adapter])
    transpose = bool(getattr(layer, "fan_in_fan_out", False))

    def merge(ts: list[torch.Tensor]) -> torch.Tensor:
        base, a, b = ts
        delta = (b.float() @ a.float()) * scaling
        if transpose:
            delta = delta.T
        return (base.float() + delta).to(base.dtype)

    return merge


def _units(module: nn.Module, lora_mode: str) -> list[_Unit]:
    lora = _lora_layers(module)
    params = {strip_wrapper_names(n): p for n, p in module.named_parameters()}
    if lora_mode == "adapter" and not lora:
        raise ValueError("lora_mode='adapter' but the module has no PEFT LoRA layers")
    units: list[_Unit] = []
    for name, p in params.items():
        adapter_match = _ADAPTER_SEG.search(name)
        if adapter_match:
            if lora_mode == "adapter":
                # PEFT's saved-adapter naming: adapter name dropped, PEFT prefix kept (vLLM's loader expects it).
                saved = name[: adapter_match.start()] + f".{adapter_match.group(1)}.weight"
                units.append(_Unit("base_model.model." + saved, [p]))
            continue
        if ".lora_magnitude_vector." in name:
            raise NotImplementedError(f"DoRA ({name}) is not supported by the weight sync")
        if lora_mode == "adapter":
            continue
        if ".original_module." in name:
            continue  # PEFT modules_to_save keeps the frozen original next to the trained copy
        name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
        if ".base_layer." in name:
            path, leaf = name.split(".base_layer.", 1)
            hf_name = f"{path}.{leaf}"
            layer = lora.get(path)
            if lora_mode == "merged" and layer is not None and leaf == "weight":
                adapters = [a for a in layer.lora_A.keys() if a in getattr(layer, "active_adapters", [a])]
                if len(adapters) != 1:
                    raise NotImplementedError(f"{path}: merging needs exactly one active adapter, got {adapters}")
                ad = adapters[0]
                a_name = f"{path}.lora_A.{ad}.weight"
                b_name = f"{path}.lora_B.{ad}.weight"
                units.append(_Unit(hf_name, [p, params[a_name], params[b_name]], _merge_fn(layer, ad)))
            else:
                units.append(_Unit(hf_name, [p]))
            continue
        units.append(_Unit(name, [p]))
    for u in units:
        m = _LAYER_KEY.match(u.name)
        u.group = m.group(1) if m else None
        ref = u.sources[0]
        u.nbytes = ref.numel() * ref.element_size()
    return units


def iter_hf_weight_buckets(
    module: nn.Module,
    bucket_megabytes: float = 2048,
    layered: bool = False,
    lora_mode: str = "merged",
    dtype: Optional[torch.dtype] = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(hf_name, full tensor)``; see :func:`iter_hf_weights`."""
    if lora_mode not in LORA_MODES:
        raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {lora_mode!r}")
    units = _units(module, lora_mode)
    limit = int(bucket_megabytes * (1 << 20))
    bucket: list[_Unit] = []
    size = 0
    for u in units:
        if layered:
            # One bucket per decoder layer (or vision block); non-layer tensors ride alone between them.
            boundary = bool(bucket) and (u.group != bucket[-1].group or u.group is None)
        else:
            boundary = bool(bucket) and size + u.nbytes > limit
        if boundary:
            yield [(b.name, b.materialize(dtype)) for b in bucket]
            bucket, size = [], 0
        bucket.append(u)
        size += u.nbytes
    if bucket:
        yield [(b.name, b.materialize(dtype)) for b in bucket]


def iter_hf_weights(
    module: nn.Module,
    bucket_megabytes: float = 2048,
    layered: bool = False,
    lora_mode: str = "merged",
    dtype: Optional[torch.dtype] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` pairs of ``module``'s weights, gathered a bucket at a time.

    ``bucket_megabytes``: upper bound of gathered bytes held at once (a tensor larger than that is its own
    bucket); upstream's ``rollout.checkpoint_engine.update_weights_bucket_megabytes``.
    ``layered``: gather one decoder layer at a time instead (``rollout.layered_summon``).
    ``lora_mode`` for PEFT models: ``"merged"`` yields base weights with ``scaling * B @ A`` folded in,
    ``"base"`` the unmerged base weights, ``"adapter"`` only the adapter tensors under PEFT's saved names
    (``base_model.model.<module>.lora_A.weight``) for an engine that loads adapters separately.
    ``dtype``: cast floating tensors (e.g. to the engine's bf16) after gathering.
    """
    for bucket in iter_hf_weight_buckets(module, bucket_megabytes, layered, lora_mode, dtype):
        yield from bucket
