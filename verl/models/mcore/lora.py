"""LoRA on megatron-core's tensor-parallel linears (the Megatron engine's ``model.lora_rank > 0``).

Each adapted ``ColumnParallelLinear`` / ``RowParallelLinear`` keeps its own parameters and names and gains two:
``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, sharded the way the base weight is, so that the local product
``lora_B @ lora_A`` is exactly this rank's shard of the full update:

==============  =======================  ========================  =========================================
base            lora_A                   lora_B                    communication of the low-rank path
==============  =======================  ========================  =========================================
column (out/TP) replicated ``[r, in]``   split ``[out/TP, r]``     no SP: the r-wide activation is copied into
                                                                   the TP region (its gradient all-reduced);
                                                                   SP: gathered along the sequence, and A's
                                                                   gradient all-reduced over TP by megatron-core
                                                                   (``param.sequence_parallel``)
row (in/TP)     split ``[r, in/TP]``     replicated ``[out, r]``   the r-wide partial sums are all-reduced (no
                                                                   SP) or reduce-scattered along the sequence
                                                                   (SP, B's gradient then all-reduced over TP)
==============  =======================  ========================  =========================================

So the adapter only ever moves r-wide activations, the base layer's own communication is unchanged, and merging
is local: ``W_local + (alpha / r) * B_local @ A_local`` is this rank's shard of the merged weight whatever the
layer's fused row layout (qkv groups, Gated DeltaNet's per-rank component blocks, gate/up halves). The weight
export merges that way (:func:`export_data`), so the rollout engine and the Hugging Face checkpoint receive
merged full weights. A fresh A is drawn for the full matrix from a generator seeded by the layer's global name and
then sliced, so a run at TP=2 starts from the same adapter as at TP=1; B starts at zero (the model starts equal
to its base).

Routed experts (``SequentialMLP``'s per-expert linears, with the expert-tensor-parallel group) are adapted like
any linear; the grouped-GEMM expert path defers to the per-expert loop while an expert carries an adapter
(verl/models/mcore/grouped_experts.py). Expert tensor parallelism > 1 with adapted experts is refused.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from verl.utils.config import cfg_get

__all__ = ["LoRASettings", "lora_settings", "apply_lora", "adapted_modules", "export_data", "lora_disabled",
           "is_lora_param", "ALL_LINEAR"]

ALL_LINEAR = "all-linear"
# Never adapted (as upstream's Megatron LoRA): the output layer (vocab-parallel head), the MoE router.
_NEVER = ("output_layer", "router")


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = (ALL_LINEAR,)
    excludes: tuple = ()
    a_init: str = "xavier"
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _as_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def lora_settings(model_cfg: Any, seed: int = 0) -> Optional[LoRASettings]:
    """The adapter of a ``model`` section (flat keys, which ``model.lora.*`` was settled into), or None."""
    rank = int(cfg_get(model_cfg, "lora_rank", 0) or 0)
    if rank <= 0:
        return None
    section = cfg_get(model_cfg, "lora", None) or {}
    a_init = cfg_get(section, "lora_A_init_method", None) or "xavier"  # upstream's Megatron LoRA default
    if a_init not in ("xavier", "kaiming"):
        raise ValueError(f"model.lora.lora_A_init_method={a_init!r}; choose xavier or kaiming")
    b_init = cfg_get(section, "lora_B_init_method", None) or "zero"
    if b_init != "zero":
        raise ValueError(f"model.lora.lora_B_init_method={b_init!r}; only zero is allowed (the adapted model must "
                         "start equal to its base)")
    targets = _as_tuple(cfg_get(model_cfg, "target_modules", ALL_LINEAR)) or (ALL_LINEAR,)
    return LoRASettings(rank=rank, alpha=float(cfg_get(model_cfg, "lora_alpha", 16) or 16),
                        dropout=float(cfg_get(model_cfg, "lora_dropout", 0.0) or 0.0), targets=targets,
                        excludes=_as_tuple(cfg_get(model_cfg, "exclude_modules", None)), a_init=a_init, seed=seed)


# ------------------------------------------------------------------------------------------------ selection
def _parallel_kind(module: nn.Module) -> Optional[str]:
    from megatron.core import tensor_parallel as tpl

    if isinstance(module, tpl.ColumnParallelLinear):
        return "column"
    if isinstance(module, tpl.RowParallelLinear):
        return "row"
    return None


def _matches(name: str, pattern: str) -> bool:
    """``linear_qkv`` matches a module of that name anywhere; a pattern with ``*``/``.`` matches the full name."""
    if any(c in pattern for c in "*?[."):
        return fnmatch.fnmatchcase(name, pattern)
    return name.rsplit(".", 1)[-1] == pattern


def _selected(name: str, s: LoRASettings) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _NEVER or any(part in _NEVER for part in name.split(".")):
        return False
    if any(_matches(name, p) for p in s.excludes):
        return False
    return ALL_LINEAR in s.targets or any(_matches(name, p) for p in s.targets)


def target_names(model: nn.Module) -> set[str]:
    """Leaf names of the tensor-parallel linears a model has (what ``target_modules`` may name)."""
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _parallel_kind(m) is not None}


# ------------------------------------------------------------------------------------------------ the adapter
def _tp_size(module: nn.Module) -> int:
    group = getattr(module, "tp_group", None)
    return group.size() if group is not None else 1


def _tp_rank(module: nn.Module) -> int:
    group = getattr(module, "tp_group", None)
    return group.rank() if group is not None else 0


class _LoRAForward:
    """Mixed into an adapted linear's class: base output plus the low-rank path (module docstring)."""

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        if not self.lora_enabled:
            return out, bias
        return out + self._lora_delta(input_).to(out.dtype), bias

    def _lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        x = self.lora_dropout(x)
        a, b = self.lora_A, self.lora_B
        comm = _tp_size(self) > 1 and not getattr(self, "explicit_expert_comm", False)
        group = getattr(self, "tp_group", None)
        if self.lora_kind == "row" and comm and not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, group=group)
        h = torch.matmul(x.to(a.dtype), a.t())  # [.., r]: this rank's input (column: whole, row: its shard)
        if self.lora_kind == "column":
            if comm and self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=group)
            elif comm:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=group)
        elif comm and self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
        elif comm:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        delta = torch.matmul(h, b.t()) * self.lora_scaling
        if self.lora_kind == "column" and comm and self.gather_output:
            delta = mappings.gather_from_tensor_model_parallel_region(delta, group=group)
        return delta

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base layer's distributed-checkpoint view plus the adapter, split like the weight it adapts."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"lora_B": 0} if self.lora_kind == "column" else {"lora_A": 1}
        own = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                       dp_cp_group=metadata["dp_cp_group"]))
        return out


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LoRAForward, cls), {})
    return _CLASSES[cls]


def _fresh_a(global_name: str, shape: tuple, s: LoRASettings) -> torch.Tensor:
    """The full ``[r, in]`` A of one layer, the same on every rank and at every TP size."""
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + zlib.crc32(global_name.encode()))
    a = torch.empty(shape, dtype=torch.float32)
    if s.a_init == "xavier":
        bound = math.sqrt(6.0 / (shape[0] + shape[1]))
    else:  # kaiming-uniform with a=sqrt(5), nn.Linear's (and PEFT's) init of A
        bound = 1.0 / math.sqrt(shape[1])
    return a.uniform_(-bound, bound, generator=gen)


def _adapt(module: nn.Module, kind: str, global_name: str, s: LoRASettings, dtype: torch.dtype) -> None:
    weight = module.weight
    out_local, in_local = weight.shape
    tp, rank = _tp_size(module), _tp_rank(module)
    in_full = in_local * tp if kind == "row" else in_local
    a_full = _fresh_a(global_name, (s.rank, in_full), s)
    a = a_full if kind == "column" else a_full[:, rank * in_local:(rank + 1) * in_local]
    device = weight.device
    module.lora_A = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
    module.lora_B = nn.Parameter(torch.zeros(out_local, s.rank, device=device, dtype=dtype))
    comm = tp > 1 and not getattr(module, "explicit_expert_comm", False)
    if comm and getattr(module, "sequence_parallel", False):
        # each rank sees a slice of the sequence: the replicated factor's gradient is summed over TP by
        # megatron-core's finalize_model_grads, as for the layer norms under SP
        (module.lora_A if kind == "column" else module.lora_B).sequence_parallel = True
    from megatron.core import tensor_parallel as tpl

    split = module.lora_B if kind == "column" else module.lora_A
    tpl.set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
    module.lora_kind = kind
    module.lora_scaling = s.scaling
    module.lora_enabled = True
    module.lora_dropout = nn.Dropout(s.dropout) if s.dropout > 0 else nn.Identity()
    weight._lora_owner = module  # export_data merges through this link
    module.__class__ = _adapted_class(type(module))


def apply_lora(chunks: Iterable[nn.Module], s: LoRASettings, global_name=lambda vp_stage, local: local,
               expert_tp: int = 1) -> list[str]:
    """Adapt the selected linears of every model chunk and freeze everything else; returns the adapted names.

    ``global_name(vp_stage, local)`` turns a chunk-local module name into its name in the whole model (pipeline
    stage and expert rank resolved), which seeds the adapter's A (module docstring)."""
    chunks = list(chunks)
    available: set[str] = set()
    adapted: list[str] = []
    for vp_stage, chunk in enumerate(chunks):
        available |= target_names(chunk)
        picked = [(n, m, _parallel_kind(m)) for n, m in chunk.named_modules()
                  if _parallel_kind(m) is not None and _selected(n, s)]
        for name, module, kind in picked:
            if getattr(module, "is_expert", False) and expert_tp > 1:
                raise ValueError(f"LoRA on routed experts ({name}) with expert_tensor_parallel_size={expert_tp} is "
                                 "not built; set expert_tensor_parallel_size=1, or leave the experts out with "
                                 "exclude_modules (e.g. ['*.experts.*'])")
            _adapt(module, kind, global_name(vp_stage, name), s, module.weight.dtype)
            adapted.append(name)
    named = [p for p in s.targets if p != ALL_LINEAR and not any(c in p for c in "*?[.")]
    unknown = sorted(set(named) - available)
    if unknown:
        raise ValueError(f"model.target_modules names {unknown}, which this Megatron model does not have; its "
                         f"tensor-parallel linears are {sorted(available - set(_NEVER))} (or all-linear)")
    if not adapted:
        raise ValueError(f"model.target_modules={list(s.targets)} (exclude_modules={list(s.excludes)}) selects no "
                         "linear of this Megatron model")
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad = is_lora_param(name)
    return adapted


def is_lora_param(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("lora_A", "lora_B")


def adapted_modules(chunks: Iterable[nn.Module]) -> Iterator[nn.Module]:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, _LoRAForward):
                yield module


@torch.no_grad()
def export_data(param: torch.Tensor) -> torch.Tensor:
    """A parameter's data for export: an adapted weight merged with its adapter (this rank's shard)."""
    owner = getattr(param, "_lora_owner", None)
    if owner is None or not owner.lora_enabled:
        return param.data
    delta = (owner.lora_B.float() @ owner.lora_A.float()) * owner.lora_scaling
    return (param.data.float() + delta).to(param.dtype)


@contextlib.contextmanager
def lora_disabled(chunks: Iterable[nn.Module]):
    """The base model: every adapter's path off (the reference policy of a LoRA actor)."""
    modules = list(adapted_modules(chunks))
    saved = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, on in zip(modules, saved):
            m.lora_enabled = on
