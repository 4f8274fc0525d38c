"""What the framework knows about one architecture (:class:`ModelSpec`) and the table of them.

Shared code (monkey patching, both engines, weight sync, the hf engine, FLOPs, LoRA, the NPU paths) asks the
spec of a checkpoint and never its ``model_type``. Each architecture package (``verl/models/<arch>/``) builds
its specs and registers them here from its ``spec.py``; :mod:`verl.models` imports those packages, so a new
model is one folder plus one line in :data:`verl.models.MODEL_PACKAGES`. Any other Hugging Face causal LM gets
the generic spec (stock forward, HF packing via position ids, no Ulysses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from verl.utils.model_specs import set_model_spec_lookup
from verl.utils.registry import Registry, import_dotted

__all__ = [
    "ModelSpec", "SUPPORTED_ARCHITECTURES", "MODEL_TYPE_FAMILIES", "GENERIC_FLOPS_FAMILIES", "register_model_spec",
    "register_model_types", "get_model_spec", "get_text_config", "is_supported_architecture", "check_model_type",
]


@dataclass(frozen=True)
class ModelSpec:
    """Everything the framework knows about one architecture; workers and engines ask this, never model_type.

    The string fields that name code are dotted paths, imported on first use (:meth:`resolve`) so that reading
    a spec imports neither transformers' modeling files nor megatron.
    """

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
    # ``fn(model, ulysses_sp_size) -> int`` installing the packed / Ulysses-aware forwards on a loaded model's
    # modules (verl.models.transformers.monkey_patch calls it); None: the stock HF forward.
    patches: Optional[str] = None
    # Packed rows work without flash-attn varlen (the patched forwards find boundaries from position ids).
    native_packing: bool = False
    # LoRA: leaf names that ``target_modules=all-linear`` expands to (None: PEFT's own all-linear rule), and
    # the fused MoE expert parameters PEFT's ``target_parameters`` can adapt.
    lora_all_linear: Optional[tuple[str, ...]] = None
    lora_fused_expert_params: tuple[str, ...] = ()
    # Weight-sync name rules (HF name -> rollout-engine names): a layout class with
    # ``from_hf_config(hf_config, **kw)`` (see verl.workers.weight_sync.names.EngineLayout); None: engine names
    # equal HF names.
    weight_sync_layout: Optional[str] = None
    # FLOPs of one forward, ``fn(hf_config, batch_seqlens) -> float`` (read by verl.utils.flops_counter);
    # None: no formula (MFU reads 0, with a warning).
    flops_fn: Optional[str] = None
    # Key of the model in verl.models.mcore's registry (read by its get_supported_model); None: not on Megatron
    # unless registered there under the checkpoint's architecture.
    mcore_model: Optional[str] = None
    # Oldest vLLM release (with its matching vLLM-Ascend) that runs this architecture on Ascend NPUs, checked
    # before a rollout engine starts there; None: any release in the patches' supported window.
    min_vllm_ascend: Optional[str] = None
    # ``fn(spec) -> list[str]`` installing fused Ascend forwards for this model (called at model load on NPU
    # hosts only); None: the stock forward runs there.
    npu_patch: Optional[str] = None
    # hf rollout engine's decode runner, a class ``Runner(module, backend)`` (verl.workers.rollout.hf_engine);
    # None: the hf rollout generates with ``module.generate``.
    hf_runner: Optional[str] = None
    # ``fn(on_cuda, engine, use_remove_padding) -> {part: KernelChoice}`` for the model's own fast kernels
    # (reported at start-up by verl.models.kernels next to packed attention); None: no parts of its own.
    kernels: Optional[str] = None
    # What vLLM needs registered to run this architecture (dotted path of a function taking no arguments, called
    # by the project's vLLM plugin in every vLLM process); None: vLLM runs it as installed.
    vllm_registration: Optional[str] = None
    # The transformers modeling file of this architecture (dotted module path), where the patched forwards and
    # the hf decode runner find the plain helpers they reuse (``apply_rotary_pos_emb``,
    # ``load_balancing_loss_func``, output classes). Named here because a module's runtime class may live
    # elsewhere: FSDP2 wraps a module in a subclass created in torch's FSDP package. None: the module of the
    # model's own (unwrapped) class (:func:`verl.models.transformers.patching.modeling_module`).
    hf_modeling: Optional[str] = None
    # Multi-token prediction (upstream's ``model.mtp``): a class with ``attach(model, path, key)`` (load the
    # checkpoint's MTP head onto the HF model) and ``runner(model, detach_encoder)`` (the object that computes
    # the MTP loss during the forward); None: the architecture has no MTP support here.
    mtp: Optional[str] = None

    def resolve(self, field_name: str):
        """Import a dotted-path field (``patches``, ``weight_sync_layout``, ``flops_fn`` ...); None stays None."""
        path = getattr(self, field_name)
        return None if path is None else import_dotted(path)

    def packs_with(self, hf_config) -> bool:
        """Whether packed (1, T) rows are correct for this model as loaded: natively patched, or through
        flash-attn's varlen kernel (HF packing by position ids) for other models."""
        if not self.supports_packing:
            return False
        return self.native_packing or getattr(hf_config, "_attn_implementation", "") == "flash_attention_2"


# architecture (config.json ``architectures[0]``) -> spec; filled by the architecture packages.
SUPPORTED_ARCHITECTURES = Registry("model architecture", config_key="config.json architectures")
# model_type (top-level or text sub-config) -> (family, text-only architecture, vision-language architecture):
# finds the spec of a checkpoint whose config.json lists no architectures.
MODEL_TYPE_FAMILIES = Registry("model type", config_key="config.json model_type")

# Generic architectures whose FLOPs the dense-decoder formula counts (GQA attention + SwiGLU MLP per layer).
GENERIC_FLOPS_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_GENERIC_FLOPS_FN = "verl.utils.flops_counter.dense_decoder_forward_flops"


def register_model_spec(spec: ModelSpec, override: bool = False) -> ModelSpec:
    """Make ``spec`` the answer for checkpoints whose ``architectures`` name ``spec.architecture``."""
    SUPPORTED_ARCHITECTURES.register(spec.architecture, spec, override=override)
    return spec


def register_model_types(model_types, family: str, text_arch: str, vl_arch: Optional[str] = None) -> None:
    """Map ``model_types`` (e.g. ``qwen3_5`` and ``qwen3_5_text``) to ``family`` and to the architecture a
    checkpoint without ``architectures`` gets (``vl_arch`` when its config has a vision tower)."""
    for model_type in model_types:
        MODEL_TYPE_FAMILIES.register(model_type, (family, text_arch, vl_arch or text_arch))


def _family(model_type: Optional[str]) -> Optional[str]:
    if model_type is None:
        return None
    if model_type in MODEL_TYPE_FAMILIES:
        return MODEL_TYPE_FAMILIES[model_type][0]
    return model_type[: -len("_text")] if model_type.endswith("_text") else model_type


def get_text_config(hf_config):
    """The config holding the language-model hyper-parameters (the config itself for text checkpoints)."""
    sub = getattr(hf_config, "text_config", None)
    return sub if sub is not None else hf_config


def _is_vl_config(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def _registered_by_model_type(hf_config) -> Optional[ModelSpec]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_TYPE_FAMILIES:
        return None
    _, text_arch, vl_arch = MODEL_TYPE_FAMILIES[model_type]
    return SUPPORTED_ARCHITECTURES[vl_arch if _is_vl_config(hf_config) else text_arch]


def get_model_spec(hf_config) -> ModelSpec:
    """Spec for a checkpoint's config: by its declared architecture, else by model_type, else generic."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    spec = _registered_by_model_type(hf_config)
    return spec if spec is not None else _generic_spec(hf_config)


def _generic_spec(hf_config) -> ModelSpec:
    archs = getattr(hf_config, "architectures", None) or []
    is_vl = _is_vl_config(hf_config)
    text = get_text_config(hf_config)
    text_family = _family(getattr(text, "model_type", None))
    return ModelSpec(
        architecture=archs[0] if archs else "AutoModelForCausalLM",
        family=_family(getattr(hf_config, "model_type", None)) or "unknown",
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



# Ground-floor utilities (FLOPs counter, vLLM-Ascend version floor) read specs through this hook: utils may not
# import models.
set_model_spec_lookup(get_model_spec)
