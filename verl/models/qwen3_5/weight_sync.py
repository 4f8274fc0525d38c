"""Qwen3.5's rollout-engine name layout: the shared vLLM fusions plus the Gated DeltaNet input projections
(``in_proj_qkv`` + ``in_proj_z`` -> ``in_proj_qkvz``, ``in_proj_b`` + ``in_proj_a`` -> ``in_proj_ba``). The vision
tower, MTP head and tied LM head rules are the shared layout's (``vl``, ``language_model_only``, tying)."""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.weight_sync.names import EngineLayout

_GDN_STACKED = (
    ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_qkvz.weight", "qkv"),
    ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_qkvz.weight", "z"),
    ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_ba.weight", "b"),
    ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_ba.weight", "a"),
)
_GDN_REQUIRED = (
    ("linear_attn.in_proj_qkvz.weight", frozenset({"qkv", "z"})),
    ("linear_attn.in_proj_ba.weight", frozenset({"b", "a"})),
)


@dataclass(frozen=True)
class Qwen35Layout(EngineLayout):
    stacked = EngineLayout.stacked + _GDN_STACKED
    required = EngineLayout.required + _GDN_REQUIRED
