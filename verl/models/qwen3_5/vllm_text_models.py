"""vLLM model classes for the text-only Qwen3.5 checkpoints (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``).

Imported by vLLM only, when it resolves one of these architectures (registered lazily by
:mod:`verl.models.qwen3_5.vllm_arch`), so this module may import vLLM at the top.

Why these exist: transformers saves a text-only Qwen3.5 as ``Qwen3_5ForCausalLM`` with a ``Qwen3_5TextConfig``.
vLLM 0.26 has a class of that name but does not register it; the name then resolves to the multimodal
``Qwen3_5ForConditionalGeneration``, which rejects a text config. vLLM's text class also lacks the
``IsHybrid`` hooks that size the Gated DeltaNet state cache; those hooks read only the model and cache
configs (``hf_text_config``), so the multimodal class's own implementations serve the text model unchanged.
"""

from __future__ import annotations

from vllm.model_executor.models.interfaces import IsHybrid
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)


def _hybrid_hooks(multimodal_cls) -> dict:
    """The three ``IsHybrid`` class methods of ``multimodal_cls``, rebound to the class they are set on."""
    names = ("get_mamba_state_dtype_from_config", "get_mamba_state_shape_from_config", "get_mamba_state_copy_func")
    return {n: classmethod(getattr(multimodal_cls, n).__func__) for n in names}


Qwen3_5TextForCausalLM = type(
    "Qwen3_5TextForCausalLM", (Qwen3_5ForCausalLM, IsHybrid), _hybrid_hooks(Qwen3_5ForConditionalGeneration))
Qwen3_5MoeTextForCausalLM = type(
    "Qwen3_5MoeTextForCausalLM", (Qwen3_5MoeForCausalLM, IsHybrid), _hybrid_hooks(Qwen3_5MoeForConditionalGeneration))
