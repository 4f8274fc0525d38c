"""Qwen3 dense's model spec: what the framework knows about ``Qwen3ForCausalLM``. Importing this module
registers it (imports neither transformers' modeling files nor megatron)."""

from __future__ import annotations

from verl.models.spec import ModelSpec, register_model_spec, register_model_types

QWEN3_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

QWEN3_SPEC = register_model_spec(
    ModelSpec(
        architecture="Qwen3ForCausalLM",
        family="qwen3",
        is_vl=False,
        is_moe=False,
        has_linear_attention=False,
        supports_packing=True,
        supports_ulysses=False,
        hf_class="Qwen3ForCausalLM",
        text_class="Qwen3ForCausalLM",
        auto_class="AutoModelForCausalLM",
        patches="verl.models.qwen3.hf_patch.patch_qwen3_modules",
        native_packing=True,  # the patched forward finds sequence boundaries itself: no flash-attn needed
        lora_all_linear=QWEN3_ALL_LINEAR,
        flops_fn="verl.utils.flops_counter.dense_decoder_forward_flops",  # GQA attention + SwiGLU MLP
        hf_modeling="transformers.models.qwen3.modeling_qwen3",
    )
)
register_model_types(("qwen3",), "qwen3", "Qwen3ForCausalLM")
