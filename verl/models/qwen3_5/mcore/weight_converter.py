"""Qwen3.5 weights between Hugging Face checkpoints and the megatron-core model of :mod:`verl.models.qwen3_5.mcore`.

Pure torch (no megatron import), so every layout rule is tested on CPU.

Three forms of the same mapping:

* :func:`mcore_state_for_rank` — the state dict of one model chunk on one rank (pipeline stage, virtual stage,
  tensor rank, expert rank), pulling HF tensors by name through a getter (so a loader reads only what the rank
  needs from safetensors); :func:`hf_to_mcore_shards` runs it for every rank of a layout.
* :func:`mcore_to_hf` — the streaming form for weight sync and export: one mcore parameter by its *global* name
  with its tensor gathered over tensor (or expert-tensor) ranks -> ``[(hf_name, tensor), ...]``.
  :func:`global_mcore_name` turns a chunk-local name (layer and expert indices local to the stage / expert
  rank) into the global one; :func:`gather_tp` concatenates per-rank shards the way the model splits them.
* :func:`mcore_shards_to_hf` — the inverse of :func:`hf_to_mcore_shards` (export, tests).

mcore layouts (per tensor rank ``r`` of ``tp``; "fused" tensors hold each component's ``r``-th slice back to
back, so one column-parallel GEMM serves them all and the gathered tensor is the rank blocks concatenated):

=====================================================  ===============================================
``self_attention.in_proj.weight`` (Gated DeltaNet)     [q_r, k_r, v_r, z_r, b_r, a_r] of in_proj_qkv/z/b/a
``self_attention.conv1d.weight``                       [q_r, k_r, v_r] channels of conv1d.weight (C, 1, W)
``self_attention.A_log`` / ``dt_bias``                 value heads split
``self_attention.out_proj.weight``                     input dim split (row parallel)
``self_attention.linear_qkv.weight`` (attention)       [qg_r, k_r, v_r]; qg keeps HF's per-head [q_h; gate_h]
``mlp.linear_fc1.weight`` (dense, shared, experts)     [gate_r, up_r]
``mlp.experts.local_experts.{j}.*``                    expert ``ep_rank * E/ep + j``, split over ``etp``
``output_layer.weight``                                vocab split; absent when tied and on the same stage
=====================================================  ===============================================

Routed experts are emitted in checkpoint layout (``mlp.experts.{e}.gate_proj.weight`` ...) or, with
``expert_format="fused"``, as HF's module tensors ``mlp.experts.gate_up_proj`` [E, 2I, H] /
``mlp.experts.down_proj`` [E, H, I] (what :mod:`verl.workers.weight_sync.names` takes; it expands them again
for engines that load per-expert names). Vision-tower and MTP weights have no mcore counterpart: they are
skipped on load and must be copied from the source checkpoint on export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Optional

import torch

from verl.models.mcore.config_converter import is_moe, tie_word_embeddings
from verl.models.mcore.weight_loading import PER_EXPERT_RE, hf_getter, strip_wrapper_prefix
from verl.models.qwen3_5.mcore.config import layer_pattern
from verl.models.spec import get_text_config

__all__ = [
    "ParallelLayout", "Qwen35Dims", "layer_offset", "mcore_state_for_rank", "hf_to_mcore_shards", "mcore_to_hf",
    "global_mcore_name", "gather_tp", "mcore_shards_to_hf", "ExpertFuser", "strip_wrapper_prefix", "hf_getter",
    "safetensors_getter", "load_mcore_state", "to_hf_stream", "partition_dim", "is_expert_param",
]


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel size; megatron-core's default is tp
    vpp: int = 1

    @property
    def etp_size(self) -> int:
        return self.tp if self.etp is None else self.etp


@dataclass(frozen=True)
class Qwen35Dims:
    layers: int
    pattern: tuple  # 1 = Gated DeltaNet, 0 = full attention
    heads: int
    kv_heads: int
    head_dim: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    num_experts: int
    vl: bool
    tied: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, hf_config) -> "Qwen35Dims":
        text = get_text_config(hf_config)
        return cls(
            layers=int(text.num_hidden_layers),
            pattern=tuple(layer_pattern(text)),
            heads=int(text.num_attention_heads),
            kv_heads=int(text.num_key_value_heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads),
            k_heads=int(text.linear_num_key_heads),
            v_heads=int(text.linear_num_value_heads),
            k_dim=int(text.linear_key_head_dim),
            v_dim=int(text.linear_value_head_dim),
            num_experts=int(getattr(text, "num_experts", 0) or 0) if is_moe(hf_config) else 0,
            vl=getattr(hf_config, "text_config", None) is not None,
            tied=tie_word_embeddings(hf_config),
            attention_bias=bool(getattr(text, "attention_bias", False)),
        )

    @property
    def hf_prefix(self) -> str:
        return "model.language_model." if self.vl else "model."


# ----------------------------------------------------------------------------------------------------------
# Rules: one per mcore parameter (relative to its layer)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """``kind``: rep (replicated), col (dim 0 split), row (dim 1 split) or fused (dim-0 components, each split).

    ``hf``: HF names relative to the layer (or model) prefix; for fused rules ``sizes`` gives, per HF tensor,
    the dim-0 sizes of the components it contributes.
    """

    kind: str
    hf: tuple
    sizes: tuple = ()
    expert: bool = False  # split over the expert-tensor group instead of the tensor group

    @property
    def partition_dim(self) -> Optional[int]:
        return {"rep": None, "col": 0, "row": 1, "fused": 0}[self.kind]


def _layer_rules(dims: Qwen35Dims, linear: bool, moe: bool) -> dict[str, Rule]:
    rules = {
        "input_layernorm.weight": Rule("rep", ("input_layernorm.weight",)),
        "pre_mlp_layernorm.weight": Rule("rep", ("post_attention_layernorm.weight",)),
    }
    if linear:
        kd, vd, nv = dims.k_heads * dims.k_dim, dims.v_heads * dims.v_dim, dims.v_heads
        la = "linear_attn."
        rules.update({
            "self_attention.in_proj.weight": Rule(
                "fused",
                (la + "in_proj_qkv.weight", la + "in_proj_z.weight", la + "in_proj_b.weight", la + "in_proj_a.weight"),
                ((kd, kd, vd), (vd,), (nv,), (nv,)),
            ),
            "self_attention.conv1d.weight": Rule("fused", (la + "conv1d.weight",), ((kd, kd, vd),)),
            "self_attention.A_log": Rule("col", (la + "A_log",)),
            "self_attention.dt_bias": Rule("col", (la + "dt_bias",)),
            "self_attention.norm.weight": Rule("rep", (la + "norm.weight",)),
            "self_attention.out_proj.weight": Rule("row", (la + "out_proj.weight",)),
        })
    else:
        qg, kv = 2 * dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
        sa = "self_attn."
        qkv = ("q_proj", "k_proj", "v_proj")
        rules.update({
            "self_attention.linear_qkv.weight": Rule("fused", tuple(sa + p + ".weight" for p in qkv),
                                                     ((qg,), (kv,), (kv,))),
            "self_attention.q_layernorm.weight": Rule("rep", (sa + "q_norm.weight",)),
            "self_attention.k_layernorm.weight": Rule("rep", (sa + "k_norm.weight",)),
            "self_attention.linear_proj.weight": Rule("row", (sa + "o_proj.weight",)),
        })
        if dims.attention_bias:
            rules["self_attention.linear_qkv.bias"] = Rule("fused", tuple(sa + p + ".bias" for p in qkv),
                                                           ((qg,), (kv,), (kv,)))
    if moe:
        rules.update({
            "mlp.router.weight": Rule("rep", ("mlp.gate.weight",)),
            "mlp.shared_experts.linear_fc1.weight": Rule(
                "fused", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), ((None,), (None,))
            ),
            "mlp.shared_experts.linear_fc2.weight": Rule("row", ("mlp.shared_expert.down_proj.weight",)),
            "mlp.shared_experts.gate_weight": Rule("rep", ("mlp.shared_expert_gate.weight",)),
        })
    else:
        rules.update({
            "mlp.linear_fc1.weight": Rule("fused", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), ((None,), (None,))),
            "mlp.linear_fc2.weight": Rule("row", ("mlp.down_proj.weight",)),
        })
    return rules


def _expert_rules(e: int) -> dict[str, Rule]:
    p = f"mlp.experts.{e}."
    return {
        "linear_fc1.weight": Rule("fused", (p + "gate_proj.weight", p + "up_proj.weight"), ((None,), (None,)), True),
        "linear_fc2.weight": Rule("row", (p + "down_proj.weight",), expert=True),
    }


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _top_rules(dims: Qwen35Dims) -> dict[str, tuple[Rule, str]]:
    """Non-layer parameters -> (rule, absolute HF name)."""
    p = dims.hf_prefix
    return {
        "embedding.word_embeddings.weight": (Rule("col", ("embed_tokens.weight",)), p + "embed_tokens.weight"),
        "decoder.final_layernorm.weight": (Rule("rep", ("norm.weight",)), p + "norm.weight"),
        "output_layer.weight": (Rule("col", ("lm_head.weight",)),
                                p + "embed_tokens.weight" if dims.tied else "lm_head.weight"),
    }


def _resolve(name: str, dims: Qwen35Dims) -> tuple[Rule, list[str]]:
    """Global mcore name -> (rule, absolute HF names)."""
    top = _top_rules(dims)
    if name in top:
        rule, hf = top[name]
        return rule, [hf]
    m = _LAYER_RE.match(name)
    if m is None:
        raise KeyError(f"{name!r} is not a Qwen3.5 megatron-core parameter")
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= dims.layers:
        raise KeyError(f"{name!r}: layer {layer} out of range (the model has {dims.layers})")
    lp = f"{dims.hf_prefix}layers.{layer}."
    em = _EXPERT_RE.match(rest)
    if em is not None and dims.num_experts:
        e, sub = int(em.group(1)), em.group(2)
        if e >= dims.num_experts:
            raise KeyError(f"{name!r}: expert {e} out of range (the model has {dims.num_experts})")
        rule = _expert_rules(e).get(sub)
    else:
        rule = _layer_rules(dims, bool(dims.pattern[layer]), dims.num_experts > 0).get(rest)
    if rule is None:
        raise KeyError(f"{name!r} is not a Qwen3.5 megatron-core parameter")
    return rule, [lp + h for h in rule.hf]


# ----------------------------------------------------------------------------------------------------------
# Splitting and joining
# ----------------------------------------------------------------------------------------------------------


def _components(rule: Rule, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    comps = []
    for t, sizes in zip(tensors, rule.sizes):
        comps.extend([t] if sizes == (None,) else list(torch.split(t, list(sizes), dim=0)))
    return comps


def _split(rule: Rule, tensors: list[torch.Tensor], rank: int, size: int) -> torch.Tensor:
    if rule.kind == "rep":
        return tensors[0].clone()
    if rule.kind in ("col", "row"):
        t = tensors[0]
        dim = rule.partition_dim
        if t.shape[dim] % size:
            raise ValueError(f"{rule.hf[0]}: dim {dim} ({t.shape[dim]}) is not divisible by {size}")
        return t.chunk(size, dim=dim)[rank].clone()
    pieces = []
    for comp in _components(rule, tensors):
        if comp.shape[0] % size:
            raise ValueError(f"{rule.hf}: component of {comp.shape[0]} rows is not divisible by {size}")
        pieces.append(comp.chunk(size, dim=0)[rank])
    return torch.cat(pieces, dim=0).contiguous()


def _join(rule: Rule, full: torch.Tensor, size: int, hf_shapes: Optional[list] = None) -> list[torch.Tensor]:
    """TP-gathered mcore tensor -> the HF tensors of ``rule`` (in ``rule.hf`` order)."""
    if rule.kind in ("rep", "col", "row"):
        return [full]
    blocks = full.chunk(size, dim=0)
    n_comps = sum(len(s) for s in rule.sizes)
    # Component sizes per rank: known sizes / size; open sizes (None) share what is left equally.
    known = [s for sizes in rule.sizes for s in sizes]
    per_rank = blocks[0].shape[0]
    fixed = sum(s // size for s in known if s is not None)
    n_open = sum(1 for s in known if s is None)
    open_size = (per_rank - fixed) // n_open if n_open else 0
    local = [open_size if s is None else s // size for s in known]
    if sum(local) != per_rank:
        raise ValueError(f"{rule.hf}: a {per_rank}-row rank block does not match component sizes {known}")
    per_comp: list[list[torch.Tensor]] = [[] for _ in range(n_comps)]
    for block in blocks:
        for i, part in enumerate(torch.split(block, local, dim=0)):
            per_comp[i].append(part)
    comps = [torch.cat(parts, dim=0) for parts in per_comp]
    out, i = [], 0
    for sizes in rule.sizes:
        out.append(torch.cat(comps[i : i + len(sizes)], dim=0))
        i += len(sizes)
    return out


def _rule_by_suffix(name: str, dims: Qwen35Dims) -> Rule:
    """The rule of a global *or chunk-local* name: it depends only on the suffix (the suffixes of Gated
    DeltaNet, attention, dense and MoE parameters are all distinct), not on which layer kind an index is."""
    name = strip_wrapper_prefix(name)
    top = _top_rules(dims)
    if name in top:
        return top[name][0]
    m = _LAYER_RE.match(name)
    rest = m.group(2) if m else name
    em = _EXPERT_RE.match(rest)
    if em is not None:
        rule = _expert_rules(0).get(em.group(2))
    else:
        moe = dims.num_experts > 0
        rule = {**_layer_rules(dims, True, moe), **_layer_rules(dims, False, moe)}.get(rest)
    if rule is None:
        raise KeyError(f"{name!r} is not a Qwen3.5 megatron-core parameter")
    return rule


def gather_tp(name: str, shards: list[torch.Tensor], hf_config) -> torch.Tensor:
    """Per-rank shards of one parameter (global or local name) -> the gathered tensor :func:`mcore_to_hf` takes."""
    dim = partition_dim(name, hf_config)
    return shards[0] if dim is None else torch.cat(list(shards), dim=dim)


def partition_dim(name: str, hf_config) -> Optional[int]:
    """Dim a parameter is split along over its tensor (or expert-tensor) group; None when replicated."""
    return _rule_by_suffix(name, Qwen35Dims.from_hf(hf_config)).partition_dim


def is_expert_param(name: str) -> bool:
    return ".mlp.experts.local_experts." in name


# ----------------------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------------------


def layer_offset(num_layers: int, layout: ParallelLayout, pp_rank: int, vp_stage: int = 0) -> int:
    """First global layer of a model chunk (even split; virtual stages interleave as in megatron-core)."""
    per_chunk = num_layers // (layout.pp * layout.vpp)
    return (vp_stage * layout.pp + pp_rank) * per_chunk


def chunk_flags(layout: ParallelLayout, pp_rank: int, vp_stage: int = 0) -> tuple[bool, bool]:
    """(pre_process, post_process) of a model chunk."""
    pre = pp_rank == 0 and vp_stage == 0
    post = pp_rank == layout.pp - 1 and vp_stage == layout.vpp - 1
    return pre, post


def global_mcore_name(local_name: str, hf_config, layout: ParallelLayout, pp_rank: int = 0, vp_stage: int = 0,
                      ep_rank: int = 0) -> str:
    """Chunk-local parameter name (layer index local to the stage, expert index local to the EP rank) -> global."""
    name = strip_wrapper_prefix(local_name)
    m = _LAYER_RE.match(name)
    if m is None:
        return name
    dims = Qwen35Dims.from_hf(hf_config)
    layer = int(m.group(1)) + layer_offset(dims.layers, layout, pp_rank, vp_stage)
    rest = m.group(2)
    em = _EXPERT_RE.match(rest)
    if em is not None:
        e = int(em.group(1)) + ep_rank * (dims.num_experts // layout.ep)
        rest = f"mlp.experts.local_experts.{e}.{em.group(2)}"
    return f"decoder.layers.{layer}.{rest}"


# ----------------------------------------------------------------------------------------------------------
# HF -> mcore
# ----------------------------------------------------------------------------------------------------------

def _chunk_names(dims: Qwen35Dims, layout: ParallelLayout, pp_rank: int, vp_stage: int, ep_rank: int):
    """(local name, global name) of every parameter in a model chunk."""
    pre, post = chunk_flags(layout, pp_rank, vp_stage)
    names = []
    if pre:
        names.append(("embedding.word_embeddings.weight",) * 2)
    per_chunk = dims.layers // (layout.pp * layout.vpp)
    first = layer_offset(dims.layers, layout, pp_rank, vp_stage)
    moe = dims.num_experts > 0
    local_experts = dims.num_experts // layout.ep if moe else 0
    for j in range(per_chunk):
        g = first + j
        for rest in _layer_rules(dims, bool(dims.pattern[g]), moe):
            names.append((f"decoder.layers.{j}.{rest}", f"decoder.layers.{g}.{rest}"))
        for le in range(local_experts):
            e = ep_rank * local_experts + le
            for sub in _expert_rules(e):
                names.append((f"decoder.layers.{j}.mlp.experts.local_experts.{le}.{sub}",
                              f"decoder.layers.{g}.mlp.experts.local_experts.{e}.{sub}"))
    if post:
        names.append(("decoder.final_layernorm.weight",) * 2)
        # Tied embeddings on one stage share the embedding tensor: megatron-core allocates no output weight.
        if not (dims.tied and pre):
            names.append(("output_layer.weight",) * 2)
    return names


def mcore_state_for_rank(
    hf_get: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
    hf_config,
    layout: ParallelLayout = ParallelLayout(),
    pp_rank: int = 0,
    vp_stage: int = 0,
    tp_rank: int = 0,
    ep_rank: int = 0,
    etp_rank: Optional[int] = None,
    value: bool = False,
) -> dict[str, torch.Tensor]:
    """The chunk-local mcore state dict of one rank, built from HF tensors fetched by name.

    ``value=True`` (a critic built from an LM checkpoint) leaves out the LM head: the value head keeps its init
    (load with ``load_mcore_state(..., keep_init=("output_layer.",))``)."""
    get = hf_getter(hf_get) if isinstance(hf_get, Mapping) else hf_get
    dims = Qwen35Dims.from_hf(hf_config)
    etp_rank = tp_rank if etp_rank is None else etp_rank
    out = {}
    for local, glob in _chunk_names(dims, layout, pp_rank, vp_stage, ep_rank):
        if value and local == "output_layer.weight":
            continue
        rule, hf_names = _resolve(glob, dims)
        rank, size = (etp_rank, layout.etp_size) if rule.expert else (tp_rank, layout.tp)
        out[local] = _split(rule, [get(n) for n in hf_names], rank, size)
    return out


def _shard_keys(layout: ParallelLayout):
    for pp_rank in range(layout.pp):
        for vp in range(layout.vpp):
            for tp_rank in range(layout.tp):
                for ep_rank in range(layout.ep):
                    yield pp_rank, vp, tp_rank, ep_rank


def _etp_rank(layout: ParallelLayout, tp_rank: int) -> int:
    if layout.etp_size == layout.tp:
        return tp_rank
    if layout.etp_size == 1:
        return 0
    raise ValueError("hf_to_mcore_shards enumerates expert_tensor_parallel_size 1 or equal to tensor parallel "
                     "size; call mcore_state_for_rank with the rank's etp_rank for other layouts")


def hf_to_mcore_shards(hf_state: Mapping[str, torch.Tensor], hf_config, layout: ParallelLayout = ParallelLayout()):
    """{(pp_rank, vp_stage, tp_rank, ep_rank): chunk-local state dict} for every rank of ``layout``."""
    get = hf_getter(hf_state)
    return {
        key: mcore_state_for_rank(get, hf_config, layout, key[0], key[1], key[2], key[3], _etp_rank(layout, key[2]))
        for key in _shard_keys(layout)
    }


# ----------------------------------------------------------------------------------------------------------
# mcore -> HF
# ----------------------------------------------------------------------------------------------------------


def mcore_to_hf(name: str, tensor: torch.Tensor, hf_config, tp_size: int = 1,
                etp_size: Optional[int] = None) -> list[tuple[str, torch.Tensor]]:
    """One gathered mcore parameter (global name) -> its HF tensors in checkpoint layout.

    ``tensor`` is gathered over the tensor group (or the expert-tensor group, size ``etp_size`` defaulting to
    ``tp_size``, for routed experts). Returns [] for the output layer of a tied model.
    """
    dims = Qwen35Dims.from_hf(hf_config)
    name = strip_wrapper_prefix(name)
    if name == "output_layer.weight" and dims.tied:
        return []
    rule, hf_names = _resolve(name, dims)
    size = (tp_size if etp_size is None else etp_size) if rule.expert else tp_size
    return list(zip(hf_names, _join(rule, tensor, size)))


class ExpertFuser:
    """Collects checkpoint-layout expert tensors and emits HF's fused ``gate_up_proj`` / ``down_proj`` per layer
    once all experts of that layer arrived; every other tensor passes through unchanged."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        m = PER_EXPERT_RE.match(hf_name)
        if m is None:
            return [(hf_name, tensor)]
        base, e, which = m.group(1), int(m.group(2)), m.group(3)
        bucket = self._pending.setdefault(base, {})
        bucket[(e, which)] = tensor
        if len(bucket) < 3 * self.num_experts:
            return []
        del self._pending[base]
        gate_up = torch.stack([torch.cat([bucket[(e, "gate")], bucket[(e, "up")]], 0) for e in range(self.num_experts)])
        down = torch.stack([bucket[(e, "down")] for e in range(self.num_experts)])
        return [(base + ".gate_up_proj", gate_up), (base + ".down_proj", down)]

    def check_empty(self) -> None:
        if self._pending:
            raise ValueError(f"experts of {sorted(self._pending)} never completed "
                             f"(got {[len(v) // 3 for v in self._pending.values()]} of {self.num_experts})")


def to_hf_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], hf_config, tp_size: int = 1,
                 etp_size: Optional[int] = None,
                 expert_format: str = "per_expert") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream of (global mcore name, gathered tensor) -> stream of HF (name, tensor).

    ``expert_format``: ``per_expert`` (checkpoint names) or ``fused`` (HF module tensors, buffered per layer
    until every expert of it has passed).
    """
    if expert_format not in ("per_expert", "fused"):
        raise ValueError(f"expert_format must be 'per_expert' or 'fused', got {expert_format!r}")
    dims = Qwen35Dims.from_hf(hf_config)
    fuser = ExpertFuser(dims.num_experts) if expert_format == "fused" and dims.num_experts else None
    for name, tensor in named_tensors:
        for hf_name, t in mcore_to_hf(name, tensor, hf_config, tp_size, etp_size):
            yield from (fuser.add(hf_name, t) if fuser is not None else [(hf_name, t)])
    if fuser is not None:
        fuser.check_empty()


def mcore_shards_to_hf(shards: Mapping[tuple, Mapping[str, torch.Tensor]], hf_config,
                       layout: ParallelLayout = ParallelLayout(), expert_format: str = "per_expert"):
    """Inverse of :func:`hf_to_mcore_shards`: gather every parameter over its ranks and convert it to HF."""
    dims = Qwen35Dims.from_hf(hf_config)
    out: dict[str, torch.Tensor] = {}

    def gathered():
        for pp_rank in range(layout.pp):
            for vp in range(layout.vpp):
                for ep_rank in range(layout.ep):
                    for local, glob in _chunk_names(dims, layout, pp_rank, vp, ep_rank):
                        expert = is_expert_param(glob)
                        if not expert and ep_rank:
                            continue  # dense parameters are replicated over expert ranks
                        if expert and layout.etp_size != layout.tp:
                            ranks = [next(t for t in range(layout.tp) if _etp_rank(layout, t) == r)
                                     for r in range(layout.etp_size)]
                        else:
                            ranks = range(layout.tp)
                        parts = [shards[(pp_rank, vp, t, ep_rank)][local] for t in ranks]
                        yield glob, gather_tp(glob, parts, hf_config)

    for name, tensor in to_hf_stream(gathered(), hf_config, layout.tp, layout.etp_size, expert_format):
        out[name] = tensor
    return out


# Loading helpers are model-independent (verl.models.mcore.weight_loading); re-exported so the registry's
# converter object carries them.
from verl.models.mcore.weight_loading import load_mcore_state, safetensors_getter  # noqa: E402,F401
