"""What the decode engine asks of a model (a *runner*), and which runner a checkpoint gets.

A runner is named by the model spec (``ModelSpec.hf_runner``, e.g. :class:`verl.models.qwen3_5.hf_runner.
Qwen35Runner`) and built as ``Runner(module, recurrent_backend)``. The engine only uses the members of
:class:`DecodeRunner`; a model whose spec names no runner generates through ``module.generate`` (see
:mod:`verl.workers.rollout.hf_rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from verl.models.spec import get_model_spec
from verl.workers.rollout.hf_engine.cache import CacheShape, SlotCache


@dataclass
class PrefillSeq:
    """One prompt to prefill: token ids (vision placeholders already expanded) and its processor outputs."""

    ids: list[int]
    mm: Optional[dict] = None


class DecodeRunner(Protocol):
    shape: CacheShape  # per-slot cache layout (attention KV, recurrent and conv states)
    syncs_host: bool  # a decode step syncs with the host (e.g. an expert loop): no CUDA graphs

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def prefill(self, cache: SlotCache, seqs: list[PrefillSeq], targets: list[list[int]]) -> torch.Tensor:
        """Run the prompts, write their states into the slots ``targets[i]``; last-token logits (len(seqs), V)."""

    def decode_logits(self, cache: SlotCache, b: int) -> torch.Tensor:
        """One decode step of the first ``b`` slots; logits (b, V)."""


def runner_class(hf_config) -> Optional[type]:
    """The decode runner the model spec of ``hf_config`` names (None: this model generates with ``generate``)."""
    return get_model_spec(hf_config).resolve("hf_runner")
