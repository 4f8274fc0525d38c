"""Qwen3.5's model specs (dense, MoE, and their vision-language wrappers): every piece of this package, named.

Importing this module registers the four architectures with :mod:`verl.models.spec` and the Megatron builders
with :mod:`verl.models.mcore.registry`; it imports neither transformers' modeling files nor megatron (every
piece is a dotted path, imported when first used).
"""

from __future__ import annotations

from verl.models.mcore.registry import register_mcore_model
from verl.models.spec import ModelSpec, register_model_spec, register_model_types
from verl.models.weight_loader_registry import register_megatron_checkpoint_io

_PKG = "verl.models.qwen3_5"

# LoRA (see verl/workers/lora.py for the table of what each block holds).
QWEN35_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
QWEN35_GATED_DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
QWEN35_MLP = ("gate_proj", "up_proj", "down_proj")
QWEN35_ALL_LINEAR = QWEN35_ATTENTION + QWEN35_GATED_DELTANET + QWEN35_MLP
QWEN35_FUSED_EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def qwen3_5_spec(arch: str, family: str, is_vl: bool, is_moe: bool, text_class: str) -> ModelSpec:
    return ModelSpec(
        architecture=arch,
        family=family,
        is_vl=is_vl,
        is_moe=is_moe,
        has_linear_attention=True,
        supports_packing=True,
        supports_ulysses=True,
        hf_class=arch,
        text_class=text_class,
        auto_class="AutoModelForImageTextToText" if is_vl else "AutoModelForCausalLM",
        text_config_attr="text_config" if is_vl else None,
        patches=f"{_PKG}.hf_patch.patch_qwen3_5_modules",
        native_packing=True,
        lora_all_linear=QWEN35_ALL_LINEAR,
        lora_fused_expert_params=QWEN35_FUSED_EXPERT_PARAMS if is_moe else (),
        weight_sync_layout=f"{_PKG}.weight_sync.Qwen35Layout",
        flops_fn=f"{_PKG}.flops.qwen3_5_forward_flops",
        mcore_model=arch,
        min_vllm_ascend="0.18.0",  # Gated DeltaNet and Qwen3.5-MoE first run on vLLM-Ascend 0.18.0
        npu_patch=f"{_PKG}.npu_patch.apply_npu_patches_for_spec",
        hf_runner=f"{_PKG}.hf_runner.Qwen35Runner",
        kernels=f"{_PKG}.kernels.kernel_choices",
        vllm_registration=f"{_PKG}.vllm_arch.register_text_architectures",
        hf_modeling=f"transformers.models.{family}.modeling_{family}",
        mtp=f"{_PKG}.mtp.Qwen35MTPSupport",
    )


SPECS = (
    qwen3_5_spec("Qwen3_5ForCausalLM", "qwen3_5", False, False, "Qwen3_5ForCausalLM"),
    qwen3_5_spec("Qwen3_5MoeForCausalLM", "qwen3_5_moe", False, True, "Qwen3_5MoeForCausalLM"),
    qwen3_5_spec("Qwen3_5ForConditionalGeneration", "qwen3_5", True, False, "Qwen3_5ForCausalLM"),
    qwen3_5_spec("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", True, True, "Qwen3_5MoeForCausalLM"),
)
for _spec in SPECS:
    register_model_spec(_spec)
    # The Megatron backend builds every one of them (VL checkpoints train their language model there).
    register_mcore_model(
        _spec.architecture,
        config_converter=f"{_PKG}.mcore.config.qwen3_5_transformer_config_kwargs",
        initializer=f"{_PKG}.mcore.model.build_qwen3_5_model",
        forward=f"{_PKG}.mcore.forward.qwen3_5_forward",
        weight_converter=f"{_PKG}.mcore.weight_converter",
    )
    register_megatron_checkpoint_io(_spec.architecture)  # the generic GPT loader / saver, via the converter
register_model_types(("qwen3_5", "qwen3_5_text"), "qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
register_model_types(
    ("qwen3_5_moe", "qwen3_5_moe_text"), "qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"
)
