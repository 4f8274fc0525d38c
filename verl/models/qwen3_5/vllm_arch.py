"""Make vLLM run the text-only Qwen3.5 checkpoints (called by the vLLM plugin of this package, see
:mod:`verl.workers.rollout.vllm_rollout.plugin`).

Each text architecture is registered only where the installed vLLM does not know it already (newer vLLM
releases may register it themselves; their own class then wins). Registration is lazy (``"module:Class"``):
vLLM imports :mod:`verl.models.qwen3_5.vllm_text_models` only when a checkpoint names the architecture, so
loading the plugin never initialises CUDA.
"""

from __future__ import annotations

# text-only architecture -> (our vLLM class, the multimodal architecture whose config rules it shares)
TEXT_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": ("Qwen3_5TextForCausalLM", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
}
_CLASSES_MODULE = "verl.models.qwen3_5.vllm_text_models"


def register_text_architectures(model_registry=None, config_map=None) -> list[str]:
    """Register the missing text-only Qwen3.5 architectures with vLLM; returns the names registered now.

    ``model_registry`` / ``config_map``: vLLM's ``ModelRegistry`` and ``MODELS_CONFIG_MAP`` (the defaults);
    idempotent, as vLLM loads general plugins once per process and may do so in several processes.
    """
    if model_registry is None:
        from vllm import ModelRegistry as model_registry
    if config_map is None:
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP as config_map
    known = set(model_registry.get_supported_archs())
    added = []
    for arch, (cls_name, multimodal_arch) in TEXT_ARCHITECTURES.items():
        if arch not in known:
            model_registry.register_model(arch, f"{_CLASSES_MODULE}:{cls_name}")
            added.append(arch)
        # The config rules (Gated DeltaNet state dtype from the checkpoint's mamba_ssm_dtype) are the
        # multimodal architecture's; vLLM looks them up by the checkpoint's architecture name.
        if arch not in config_map and multimodal_arch in config_map:
            config_map[arch] = config_map[multimodal_arch]
    return added
