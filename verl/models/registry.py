"""Public entry point (seed name) for the model table: which architectures the FSDP actor supports, what each
needs, and how to load a checkpoint for training.

The table itself is :mod:`verl.models.spec` (``ModelSpec``, ``SUPPORTED_ARCHITECTURES``, ``get_model_spec``),
filled by the architecture packages (``verl/models/<arch>/spec.py``, e.g. :mod:`verl.models.qwen3_5.spec`);
this module re-exports it and adds the loaders. Any other Hugging Face causal LM goes through the generic path
(stock forward, HF packing via position ids, no Ulysses).
"""

from __future__ import annotations

from typing import Optional

import torch

from verl.models.qwen3_5.spec import QWEN35_ALL_LINEAR, QWEN35_FUSED_EXPERT_PARAMS  # noqa: F401 (seed names)
from verl.models.spec import (  # noqa: F401
    GENERIC_FLOPS_FAMILIES,
    SUPPORTED_ARCHITECTURES,
    ModelSpec,
    check_model_type,
    get_model_spec,
    get_text_config,
    is_supported_architecture,
)


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
    """Load a checkpoint for training: a registered architecture (text or VL) or any HF causal LM.

    A VL checkpoint loaded with ``for_vl=False`` becomes the matching ``*ForCausalLM`` over its text config
    (vision weights are skipped). ``config_overrides`` (``model.override_config``) are set on the config
    the model is built from, as upstream does; they must not go to ``from_pretrained`` as keyword arguments
    next to ``config=``, where transformers hands them to the model's ``__init__``. Raises ValueError for
    checkpoints that are not causal LMs.
    """
    cls, config = _class_and_config(path, trust_remote_code, for_vl, declared_model_type, config_overrides)
    kwargs = dict(from_pretrained_kwargs)
    kwargs.setdefault("dtype", dtype)
    if cls.__name__.startswith("Auto"):
        kwargs["trust_remote_code"] = trust_remote_code
    return cls.from_pretrained(path, config=config, **kwargs)


def build_hf_model_without_weights(path: str, device, dtype: torch.dtype = torch.bfloat16,
                                   trust_remote_code: bool = False, for_vl: Optional[bool] = None):
    """The model :func:`load_hf_model` would load, built on ``device`` from the checkpoint's config (and its
    generation config) without reading its weights: for a copy whose every parameter the caller then writes,
    such as the Megatron engine's copy for the hf rollout, which its weight sync fills. Until then the
    parameters hold the architecture's random initialisation. Reading the weights first would cost each rank a
    pass over the whole checkpoint through host memory (67 GB for Qwen3.5-35B-A3B, on every GPU at once)."""
    from transformers import GenerationConfig

    cls, config = _class_and_config(path, trust_remote_code, for_vl, None, None)
    with torch.device(device):
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        else:
            model = cls._from_config(config, dtype=dtype)
    try:  # as from_pretrained does: the checkpoint's EOS ids and sampling defaults
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    return model


def _class_and_config(path: str, trust_remote_code: bool, for_vl: Optional[bool], declared_model_type,
                      config_overrides):
    from transformers import AutoConfig

    from verl.models.transformers.npu_patch import apply_npu_patches_for_model

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    spec = check_model_type(config, declared_model_type)
    apply_npu_patches_for_model(config)  # Ascend only: the spec's fused torch_npu forwards, if it names any
    cls = get_model_class(config, for_vl=for_vl, trust_remote_code=trust_remote_code)
    if spec.is_vl and for_vl is False and spec.hf_class is not None:
        config = get_text_config(config)
    apply_config_overrides(config, config_overrides)
    return cls, config


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
