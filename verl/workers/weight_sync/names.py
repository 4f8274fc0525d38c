"""Parameter names between the trainer's HF module and a rollout engine's model.

Three name spaces meet when weights move from the actor to the rollout engine:

* the *trainer* name of a parameter (``module.named_parameters()``), which carries wrapper segments added by
  FSDP1, activation checkpointing, ``torch.compile`` and PEFT;
* the *HF* (checkpoint) name, what ``save_pretrained`` would write; engines load these;
* the *engine* name, the parameter inside the engine's model after its own fusions (vLLM fuses q/k/v into
  ``qkv_proj``, gate/up into ``gate_up_proj``, the Gated DeltaNet input projections into two fused matrices
  and all routed experts into ``w13_weight`` / ``w2_weight``).

This module is pure string/tensor logic (no vLLM import) so every rule is unit-tested on CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Optional

import torch

# Segments that wrappers insert into parameter names; none of them exists in a checkpoint.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
PEFT_PREFIX = "base_model.model."


def strip_wrapper_names(name: str) -> str:
    """Trainer parameter name -> HF name, minus PEFT's LoRA segments (handled in :mod:`.lora`)."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name


# ----------------------------------------------------------------------------------------------------------
# Engine layout description
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLayout:
    """What the engine's model looks like, derived from the HF config (see :meth:`from_hf_config`).

    The fusions every vLLM decoder has (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, routed experts
    into ``w13_weight`` / ``w2_weight``) are here; an architecture with more (Qwen3.5's Gated DeltaNet input
    projections) subclasses it in its package and extends :attr:`stacked` / :attr:`required`, and its model spec
    names the subclass (``ModelSpec.weight_sync_layout``).

    ``vl``: the checkpoint is a vision-language one (``model.language_model.*`` / ``model.visual.*``).
    ``language_model_only``: the engine was built without the vision tower (text rollouts of a VL checkpoint),
    so ``model.visual.*`` tensors are dropped instead of written.
    ``expert_format``: how routed experts are handed to the engine loader — ``"fused"`` keeps HF's
    ``mlp.experts.gate_up_proj`` / ``down_proj`` tensors, ``"per_expert"`` expands them into checkpoint-style
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what vLLM-Ascend's loader needs).
    """

    moe: bool = False
    vl: bool = False
    language_model_only: bool = True
    num_experts: int = 0
    tie_word_embeddings: bool = False
    expert_format: str = "fused"
    # Where the engine keeps the fused expert tensors under ``mlp.``: ``experts`` (vLLM <= 0.2x, vLLM-Ascend)
    # or ``experts.routed_experts`` (newer vLLM). :meth:`matching_engine` reads it off the engine's names.
    engine_experts_path: str = "experts"

    @classmethod
    def from_hf_config(cls, config: Any, *, language_model_only: bool = True, expert_format: str = "fused"):
        if expert_format not in ("fused", "per_expert"):
            raise ValueError(f"expert_format must be 'fused' or 'per_expert', got {expert_format!r}")
        text = getattr(config, "text_config", None)
        vl = text is not None and hasattr(config, "vision_config")
        text = text if text is not None else config
        num_experts = int(getattr(text, "num_experts", 0) or 0)
        tie = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
        return cls(
            moe=num_experts > 0,
            vl=vl,
            language_model_only=language_model_only,
            num_experts=num_experts,
            tie_word_embeddings=tie,
            expert_format=expert_format,
        )

    # (HF leaf inside a decoder layer, engine leaf, shard id), and the shards each fused engine leaf must receive
    # (experts are handled separately: they depend on E).
    stacked = (
        ("self_attn.q_proj.weight", "self_attn.qkv_proj.weight", "q"),
        ("self_attn.k_proj.weight", "self_attn.qkv_proj.weight", "k"),
        ("self_attn.v_proj.weight", "self_attn.qkv_proj.weight", "v"),
        ("shared_expert.gate_proj.weight", "shared_expert.gate_up_proj.weight", 0),
        ("shared_expert.up_proj.weight", "shared_expert.gate_up_proj.weight", 1),
        ("mlp.gate_proj.weight", "mlp.gate_up_proj.weight", 0),
        ("mlp.up_proj.weight", "mlp.gate_up_proj.weight", 1),
    )
    required = (
        ("self_attn.qkv_proj.weight", frozenset({"q", "k", "v"})),
        ("shared_expert.gate_up_proj.weight", frozenset({0, 1})),
        ("mlp.gate_up_proj.weight", frozenset({0, 1})),
    )

    def matching_engine(self, engine_param_names: Iterable[str]) -> "EngineLayout":
        """This layout with the engine-specific details read off the engine's parameter names."""
        path = "experts"
        for n in engine_param_names:
            m = re.search(r"\.mlp\.(.+)\.w13_weight$", n)
            if m:
                path = m.group(1)
                break
        return replace(self, engine_experts_path=path)


# ----------------------------------------------------------------------------------------------------------
# HF -> engine names
# ----------------------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERT = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _engine_prefix(hf_name: str, layout: EngineLayout) -> Optional[str]:
    """Rename the model-level prefix; ``None`` means the engine has no such tensor (skip it)."""
    if layout.vl:
        if hf_name.startswith("model.visual."):
            return None if layout.language_model_only else "visual." + hf_name[len("model.visual.") :]
        if hf_name.startswith("model.language_model."):
            return "language_model.model." + hf_name[len("model.language_model.") :]
        if hf_name.startswith("lm_head."):
            return None if layout.tie_word_embeddings else "language_model." + hf_name
        return hf_name
    if hf_name.startswith("lm_head.") and layout.tie_word_embeddings:
        return None  # tied: the engine shares embed_tokens and owns no separate lm_head parameter
    if hf_name.startswith("mtp."):
        return None  # multi-token-prediction head: not part of the rollout model
    return hf_name


def engine_targets(hf_name: str, layout: EngineLayout) -> list[tuple[str, Any]]:
    """The (engine parameter, shard) pairs one HF tensor writes; empty when the engine has no such tensor.

    Shards: ``None`` for a plain copy, a letter/index for a slice of a fused matrix, ``(expert, "w1"|"w2"|"w3")``
    for routed experts.
    """
    name = _engine_prefix(hf_name, layout)
    if name is None:
        return []
    m = _FUSED_EXPERT.match(name)
    if m:
        pre = m["pre"][: -len("experts")] + layout.engine_experts_path
        if m["proj"] == "gate_up_proj":
            return [(f"{pre}.w13_weight", (e, w)) for e in range(layout.num_experts) for w in ("w1", "w3")]
        return [(f"{pre}.w2_weight", (e, "w2")) for e in range(layout.num_experts)]
    m = _PER_EXPERT.match(name)
    if m:
        pre = m["pre"][: -len("experts")] + layout.engine_experts_path
        w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[m["proj"]]
        param = "w2_weight" if w == "w2" else "w13_weight"
        return [(f"{pre}.{param}", (int(m["e"]), w))]
    for hf_leaf, engine_leaf, shard in layout.stacked:
        if name.endswith("." + hf_leaf):
            return [(name[: -len(hf_leaf)] + engine_leaf, shard)]
    return [(name, None)]


def required_shards(engine_name: str, layout: EngineLayout) -> set:
    """Every shard an engine parameter must receive for a complete write."""
    if engine_name.endswith(f".{layout.engine_experts_path}.w13_weight"):
        return {(e, w) for e in range(layout.num_experts) for w in ("w1", "w3")}
    if engine_name.endswith(f".{layout.engine_experts_path}.w2_weight"):
        return {(e, "w2") for e in range(layout.num_experts)}
    for leaf, shards in layout.required:
        if engine_name.endswith("." + leaf):
            return set(shards)
    return {None}


def expected_engine_names(hf_names: Iterable[str], layout: EngineLayout) -> set[str]:
    """Engine parameter names implied by a set of HF names (for tests and dry runs without an engine)."""
    return {target for n in hf_names for target, _ in engine_targets(n, layout)}


# ----------------------------------------------------------------------------------------------------------
# Routed-expert tensor layouts
# ----------------------------------------------------------------------------------------------------------


def expand_fused_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """HF fused expert tensor -> checkpoint-style per-expert tensors (views, no copy).

    ``gate_up_proj`` [E, 2I, H] gives ``{e}.gate_proj.weight`` [I, H] (first half) and ``{e}.up_proj.weight``
    [I, H]; ``down_proj`` [E, H, I] gives ``{e}.down_proj.weight`` [H, I]. Other names pass through.
    """
    m = _FUSED_EXPERT.match(name)
    if not m:
        yield name, tensor
        return
    pre = m["pre"]
    if m["proj"] == "gate_up_proj":
        if tensor.dim() != 3 or tensor.shape[1] % 2:
            raise ValueError(f"{name}: expected [E, 2*I, H], got {tuple(tensor.shape)}")
        gate, up = tensor.chunk(2, dim=1)
        for e in range(tensor.shape[0]):
            yield f"{pre}.{e}.gate_proj.weight", gate[e]
            yield f"{pre}.{e}.up_proj.weight", up[e]
    else:
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected [E, H, I], got {tuple(tensor.shape)}")
        for e in range(tensor.shape[0]):
            yield f"{pre}.{e}.down_proj.weight", tensor[e]


def to_engine_loader_format(
    weights: Iterable[tuple[str, torch.Tensor]], layout: EngineLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Adapt HF (name, tensor) pairs to what the engine's checkpoint loader should receive.

    Drops tensors the engine does not own (vision tower for language-model-only engines, tied lm_head) and
    expands fused experts when ``layout.expert_format == "per_expert"``. Names stay checkpoint names: the
    engine's own loader applies its prefix mapping and fusions.
    """
    for name, tensor in weights:
        if not engine_targets(name, layout):
            continue
        if layout.expert_format == "per_expert":
            yield from expand_fused_experts(name, tensor)
        else:
            yield name, tensor
