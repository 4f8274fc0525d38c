"""Which architectures the FSDP actor supports, what each needs, and how to load a checkpoint for training.

Qwen3.5 is first-class (dense, MoE, and their vision-language wrappers); any other Hugging Face causal LM goes
through the generic path (stock forward, HF packing via position ids, no Ulysses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from verl.utils.registry import Registry


# Qwen3.5 LoRA knowledge (see verl/workers/lora.py for the table of what each block holds).
QWEN35_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
QWEN35_GATED_DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
QWEN35_MLP = ("gate_proj", "up_proj", "down_proj")
QWEN35_ALL_LINEAR = QWEN35_ATTENTION + QWEN35_GATED_DELTANET + QWEN35_MLP
QWEN35_FUSED_EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the framework knows about one architecture; workers and engines ask this, never model_type."""

    architecture: str
    family: str  # canonical model_type without the "_text" suffix, e.g. "qwen3_5_moe"
    is_vl: bool
    is_moe: bool
    has_linear_attention: bool
    supports_packing: bool  # remove-padding (packed (1, T) rows) forward
    supports_ulysses: bool
    hf_class: Optional[str]  # transformers class for the checkpoint as-is (None: let AutoModel decide)
    text_class: Optional[str]  # class for training only the language model of this checkpoint
    auto_class: str  # transformers Auto* class name for trust_remote_code checkpoints
    text_config_attr: Optional[str] = None  # sub-config holding the LM hyper-parameters (VL wrappers)
    # Monkey patches installed by verl.models.transformers.monkey_patch ("qwen3_5": packed / Ulysses-aware
    # forwards of every Qwen3.5 block); None: the stock HF forward.
    patches: Optional[str] = None
    # Packed rows work without flash-attn varlen (the patched forwards find boundaries from position ids).
    native_packing: bool = False
    # LoRA: leaf names that ``target_modules=all-linear`` expands to (None: PEFT's own all-linear rule), and
    # the fused MoE expert parameters PEFT's ``target_parameters`` can adapt.
    lora_all_linear: Optional[tuple[str, ...]] = None
    lora_fused_expert_params: tuple[str, ...] = ()
    # Weight-sync name rules (HF name -> rollout-engine names): dotted path of a layout class with
    # ``from_hf_config(hf_config, **kw)``; None: engine names equal HF names.
    weight_sync_layout: Optional[str] = None
    # FLOPs of one forward, ``fn(hf_config, batch_seqlens) -> float`` (dotted path), read by
    # verl.utils.flops_counter; None: no formula (MFU reads 0, with a warning).
    flops_fn: Optional[str] = None
    # Key of the model in verl.models.mcore's registry (read by its get_supported_model); None: not on Megatron
    # unless registered there under the checkpoint's architecture.
    mcore_model: Optional[str] = None
    # Oldest vLLM release (with its matching vLLM-Ascend) that runs this architecture on Ascend NPUs, checked
    # before a rollout engine starts there; None: any release in the patches' supported window.
    min_vllm_ascend: Optional[str] = None
    # What vLLM needs registered to run this architecture (dotted path of a function taking no arguments,
    # called by the project's vLLM plugin in every vLLM process); None: vLLM runs it as installed.
    vllm_registration: Optional[str] = None

    def resolve(self, field_name: str):
        """Import a dotted-path field (``weight_sync_layout``, ``flops_fn``); None stays None."""
        path = getattr(self, field_name)
        if path is None:
            return None
        from verl.utils.registry import import_dotted

        return import_dotted(path)

    def packs_with(self, hf_config) -> bool:
        """Whether packed (1, T) rows are correct for this model as loaded: natively patched, or through
        flash-attn's varlen kernel (HF packing by position ids) for other models."""
        if not self.supports_packing:
            return False
        return self.native_packing or getattr(hf_config, "_attn_implementation", "") == "flash_attention_2"


def _qwen(arch, family, is_vl, is_moe, text_class):
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
        patches="qwen3_5",
        native_packing=True,
        lora_all_linear=QWEN35_ALL_LINEAR,
        lora_fused_expert_params=QWEN35_FUSED_EXPERT_PARAMS if is_moe else (),
        weight_sync_layout="verl.workers.weight_sync.names.Qwen35Layout",
        flops_fn="verl.utils.flops_counter.qwen3_5_forward_flops",
        mcore_model=arch,
        min_vllm_ascend="0.18.0",  # Gated DeltaNet and Qwen3.5-MoE first run on vLLM-Ascend 0.18.0
        vllm_registration="verl.models.qwen3_5.vllm_arch.register_text_architectures",
    )


# architecture (config.json ``architectures[0]``) -> spec. Adding a model is one registration here.
SUPPORTED_ARCHITECTURES = Registry("model architecture", config_key="config.json architectures")
for _spec in (
    _qwen("Qwen3_5ForCausalLM", "qwen3_5", False, False, "Qwen3_5ForCausalLM"),
    _qwen("Qwen3_5MoeForCausalLM", "qwen3_5_moe", False, True, "Qwen3_5MoeForCausalLM"),
    _qwen("Qwen3_5ForConditionalGeneration", "qwen3_5", True, False, "Qwen3_5ForCausalLM"),
    _qwen("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", True, True, "Qwen3_5MoeForCausalLM"),
):
    SUPPORTED_ARCHITECTURES.register(_spec.architecture, _spec)

# model_type (top-level or text sub-config) -> family
QWEN3_5_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_FAMILY_DEFAULT_ARCH = {
    ("qwen3_5", False): "Qwen3_5ForCausalLM",
    ("qwen3_5", True): "Qwen3_5ForConditionalGeneration",
    ("qwen3_5_moe", False): "Qwen3_5MoeForCausalLM",
    ("qwen3_5_moe", True): "Qwen3_5MoeForConditionalGeneration",
}


# Generic architectures whose FLOPs the dense-decoder formula counts (GQA attention + SwiGLU MLP per layer).
GENERIC_FLOPS_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_GENERIC_FLOPS_FN = "verl.utils.flops_counter.dense_decoder_forward_flops"


def _family(model_type: Optional[str]) -> Optional[str]:
    if model_type is None:
        return None
    if model_type in QWEN3_5_MODEL_TYPES:
        return QWEN3_5_MODEL_TYPES[model_type]
    return model_type[: -len("_text")] if model_type.endswith("_text") else model_type


def get_text_config(hf_config):
    """The config holding the language-model hyper-parameters (the config itself for text checkpoints)."""
    sub = getattr(hf_config, "text_config", None)
    return sub if sub is not None else hf_config


def _is_vl_config(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def get_model_spec(hf_config) -> ModelSpec:
    """Spec for a checkpoint's config: by its declared architecture, else by model_type, else generic."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    family = _family(getattr(hf_config, "model_type", None))
    if family in ("qwen3_5", "qwen3_5_moe"):
        return SUPPORTED_ARCHITECTURES[_FAMILY_DEFAULT_ARCH[(family, _is_vl_config(hf_config))]]
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else "AutoModelForCausalLM"
    text_family = _family(getattr(get_text_config(hf_config), "model_type", None))
    is_vl = _is_vl_config(hf_config)
    text = get_text_config(hf_config)
    return ModelSpec(
        architecture=arch,
        family=family or "unknown",
        is_vl=is_vl,
        is_moe=bool(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0)),
        has_linear_attention="linear_attention" in (getattr(text, "layer_types", None) or []),
        supports_packing=True,
        supports_ulysses=False,
        hf_class=None,
        text_class=None,
        auto_class="AutoModelForImageTextToText" if is_vl else "AutoModelForCausalLM",
        text_config_attr="text_config" if getattr(hf_config, "text_config", None) is not None else None,
        flops_fn=_GENERIC_FLOPS_FN if text_family in GENERIC_FLOPS_FAMILIES else None,
    )


def is_supported_architecture(architecture: str) -> bool:
    return architecture in SUPPORTED_ARCHITECTURES


def check_model_type(hf_config, declared_model_type: Optional[str]) -> ModelSpec:
    """Validate a user-declared ``model_type`` (e.g. ``actor_rollout_ref.model.model_type=qwen3_5_text``)
    against the checkpoint. Optional: None/"" always passes.

    A declaration agrees when it names the checkpoint's family at either level: ``qwen3_5_text`` fits a
    Qwen3.5 text checkpoint and a Qwen3.5 VL checkpoint (whose text config is ``qwen3_5_text``), ``qwen3_5``
    fits both too; ``qwen3_5_moe_text`` does not fit a dense checkpoint. Returns the checkpoint's spec.
    """
    spec = get_model_spec(hf_config)
    if not declared_model_type:
        return spec
    top = getattr(hf_config, "model_type", None)
    text = getattr(get_text_config(hf_config), "model_type", None)
    accepted = {_family(top), _family(text)} - {None}
    if _family(declared_model_type) not in accepted:
        raise ValueError(
            f"model_type={declared_model_type!r} was declared, but the checkpoint is {top!r}"
            + (f" (text config {text!r})" if text and text != top else "")
            + f", architecture {spec.architecture}. Fix model.model_type or point model.path at a matching checkpoint."
        )
    return spec


def _resolve_class(name: str):
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {name}")
    return cls


def _is_causal_lm_config(hf_config) -> bool:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        # The checkpoint says what its head is (a BertModel is in the causal-LM auto mapping, but is no LM).
        return any(a.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")) for a in archs)
    mapping_types = (AutoModelForCausalLM._model_mapping, AutoModelForImageTextToText._model_mapping)
    return any(type(hf_config) in m for m in mapping_types)


def get_model_class(hf_config, for_vl: Optional[bool] = None, trust_remote_code: bool = False):
    """Class to load a checkpoint with. ``for_vl`` None keeps the checkpoint's modality; False trains only
    the language model of a VL checkpoint (its ``*ForCausalLM`` over ``text_config``); True requires VL."""
    spec = get_model_spec(hf_config)
    if not _is_causal_lm_config(hf_config):
        archs = getattr(hf_config, "architectures", None)
        raise ValueError(
            f"checkpoint with model_type={getattr(hf_config, 'model_type', None)!r} architectures={archs} "
            "is not a causal language model; the actor needs a *ForCausalLM or *ForConditionalGeneration checkpoint"
        )
    if for_vl and not spec.is_vl:
        raise ValueError(f"{spec.architecture} has no vision tower; cannot load it as a vision-language model")
    want_vl = spec.is_vl if for_vl is None else for_vl
    if spec.hf_class is not None:
        return _resolve_class(spec.hf_class if want_vl or not spec.is_vl else spec.text_class)
    import transformers

    auto = transformers.AutoModelForImageTextToText if want_vl else transformers.AutoModelForCausalLM
    return auto  # generic: Auto class resolves the concrete one (remote code included)


def load_hf_model(
    path: str,
    dtype: torch.dtype = torch.bfloat16,
    trust_remote_code: bool = False,
    for_vl: Optional[bool] = None,
    declared_model_type: Optional[str] = None,
    config_overrides=None,
    **from_pretrained_kwargs,
):
    """Load a checkpoint for training: Qwen3.5 (text or VL) or any HF causal LM.

    A VL checkpoint loaded with ``for_vl=False`` becomes the matching ``*ForCausalLM`` over its text config
    (vision weights are skipped). ``config_overrides`` (``model.override_config``) are set on the config
    the model is built from, as upstream does; they must not go to ``from_pretrained`` as keyword arguments
    next to ``config=``, where transformers hands them to the model's ``__init__``. Raises ValueError for
    checkpoints that are not causal LMs.
    """
    from transformers import AutoConfig

    from verl.models.transformers.npu_patch import apply_npu_patches_for_model

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    spec = check_model_type(config, declared_model_type)
    apply_npu_patches_for_model(config)  # Ascend only: fused torch_npu forwards for Qwen3.5
    cls = get_model_class(config, for_vl=for_vl, trust_remote_code=trust_remote_code)
    if spec.is_vl and for_vl is False and spec.hf_class is not None:
        config = get_text_config(config)
    apply_config_overrides(config, config_overrides)
    kwargs = dict(from_pretrained_kwargs)
    kwargs.setdefault("dtype", dtype)
    if cls.__name__.startswith("Auto"):
        kwargs["trust_remote_code"] = trust_remote_code
    return cls.from_pretrained(path, config=config, **kwargs)


def apply_config_overrides(config, overrides) -> None:
    """Set ``overrides`` (a dict or an OmegaConf section; None = nothing) on an HF config: a dict value for
    a nested sub-config recurses into it; a key the config lacks but its text config has (VL checkpoints)
    goes to the text config, where the text model reads it."""
    from omegaconf import OmegaConf
    from transformers import PretrainedConfig

    if overrides is None:
        return
    if OmegaConf.is_config(overrides):
        overrides = OmegaConf.to_container(overrides, resolve=True)
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            apply_config_overrides(current, value)
            continue
        text = getattr(config, "text_config", None)
        if not hasattr(config, key) and isinstance(text, PretrainedConfig) and hasattr(text, key):
            setattr(text, key, value)
        else:
            setattr(config, key, value)


class ModelRegistry:
    """Upstream-compatible view of the table above."""

    @staticmethod
    def get_supported_archs() -> list[str]:
        return list(SUPPORTED_ARCHITECTURES)

    @staticmethod
    def load_model_cls(model_arch: str, value: bool = False):
        if value or model_arch not in SUPPORTED_ARCHITECTURES:
            return None
        return _resolve_class(SUPPORTED_ARCHITECTURES[model_arch].hf_class)
