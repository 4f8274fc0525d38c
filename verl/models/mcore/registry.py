"""Which checkpoints the Megatron backend builds, and how: one registration per architecture.

Four registries, keyed by :class:`SupportedModel` (or, for models added outside this package, by the
checkpoint's architecture string), hold what the Megatron engine needs per model:

* ``MODEL_CONFIG_CONVERTER_REGISTRY``: HF config -> ``TransformerConfig`` keyword arguments (pure, no megatron import);
* ``MODEL_INITIALIZER_REGISTRY``: ``(tfconfig, hf_config, pre_process, post_process,
  share_embeddings_and_output_weights, value, vp_stage) -> torch.nn.Module`` (imports megatron-core);
* ``MODEL_FORWARD_REGISTRY``: ``fn(model, input_ids, position_ids, packed_seq_params=None, ...)``;
* ``MODEL_WEIGHT_CONVERTER_REGISTRY``: a module-like object with ``mcore_state_for_rank`` / ``mcore_to_hf`` /
  ``to_hf_stream`` / ``global_mcore_name`` / ``gather_tp`` / ``partition_dim`` (see
  :mod:`verl.models.qwen3_5.mcore.weight_converter` for Qwen3.5's).

:func:`register_mcore_model` fills all four at once (each architecture package calls it from its ``spec``);
entries may be dotted import paths, resolved on first use, so this module imports without megatron-core. See ``docs/advance/megatron_extension.md``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Optional, Union

from verl.models.mcore.config_converter import build_transformer_config, check_parallel_sizes
from verl.utils.registry import Registry

__all__ = [
    "SupportedModel", "MODEL_CONFIG_CONVERTER_REGISTRY", "MODEL_INITIALIZER_REGISTRY", "MODEL_FORWARD_REGISTRY",
    "MODEL_WEIGHT_CONVERTER_REGISTRY",
    "register_mcore_model", "get_supported_model", "hf_to_mcore_config", "init_mcore_model", "get_mcore_forward_fn",
    "get_mcore_weight_converter", "check_parallel_sizes",
]


class SupportedModel(str, Enum):
    """Architectures (``config.architectures[0]``) the Megatron backend builds out of the box (upstream's enum;
    each is registered by its architecture package, e.g. :mod:`verl.models.qwen3_5.spec`)."""

    QWEN3_5 = "Qwen3_5ForCausalLM"
    QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
    QWEN3_5_VL = "Qwen3_5ForConditionalGeneration"  # trained on text: the vision tower is not built
    QWEN3_5_MOE_VL = "Qwen3_5MoeForConditionalGeneration"

    def __str__(self) -> str:
        return self.value


_BUILT_IN = frozenset(m.value for m in SupportedModel)
_KEY = "actor_rollout_ref.model.path (its config.json architectures)"
MODEL_CONFIG_CONVERTER_REGISTRY = Registry("megatron config converter", config_key=_KEY)
MODEL_INITIALIZER_REGISTRY = Registry("megatron model initializer", config_key=_KEY)
MODEL_FORWARD_REGISTRY = Registry("megatron forward function", config_key=_KEY)
MODEL_WEIGHT_CONVERTER_REGISTRY = Registry("megatron weight converter", config_key=_KEY)
_ALL = (MODEL_CONFIG_CONVERTER_REGISTRY, MODEL_INITIALIZER_REGISTRY, MODEL_FORWARD_REGISTRY,
        MODEL_WEIGHT_CONVERTER_REGISTRY)

ModelKey = Union[SupportedModel, str]


def register_mcore_model(
    key: ModelKey,
    *,
    config_converter: Any,
    initializer: Any,
    forward: Any,
    weight_converter: Any,
    override: bool = False,
) -> ModelKey:
    """Register everything the Megatron engine needs for one architecture (objects or dotted paths)."""
    for reg, obj in zip(_ALL, (config_converter, initializer, forward, weight_converter)):
        reg.register(key, obj, override=override)
        reg.extras[key] = "mcore"
    return key


def get_supported_model(hf_config) -> ModelKey:
    """The registry key of a checkpoint: what its model spec names (``ModelSpec.mcore_model``, found by
    ``model_type`` too when ``architectures`` is absent), else its declared architecture
    (models registered here from outside, whose spec is the generic one)."""
    from verl.models.spec import get_model_spec

    wanted = [get_model_spec(hf_config).mcore_model] + list(getattr(hf_config, "architectures", None) or [])
    for name in wanted:
        for reg_key in MODEL_CONFIG_CONVERTER_REGISTRY:
            if name is not None and str(reg_key) == name:
                # Upstream's enum member for the built-in architectures (registered by string in their package).
                return SupportedModel(name) if name in _BUILT_IN else reg_key
    archs = list(getattr(hf_config, "architectures", None) or [])
    raise ValueError(
        f"the Megatron backend has no model for architectures={archs} "
        f"(model_type={getattr(hf_config, 'model_type', None)!r}); registered: "
        f"{', '.join(str(k) for k in MODEL_CONFIG_CONVERTER_REGISTRY)}. Add one with "
        "verl.models.mcore.registry.register_mcore_model (docs/advance/megatron_extension.md) or train it with "
        "actor_rollout_ref.actor.strategy=fsdp2"
    )


def _lookup(reg: Registry, hf_config) -> Any:
    key = get_supported_model(hf_config)
    obj = reg.get_or_raise(key)
    return obj


def transformer_config_kwargs(hf_config, dtype=None, **override_transformer_config) -> dict:
    """TransformerConfig kwargs (pure: no megatron import)."""
    return _lookup(MODEL_CONFIG_CONVERTER_REGISTRY, hf_config)(hf_config, dtype, **override_transformer_config)


def hf_to_mcore_config(hf_config, dtype=None, **override_transformer_config):
    """HF config -> megatron-core ``TransformerConfig`` (parallel sizes etc. come in the overrides).

    A registered converter returns TransformerConfig kwargs (pure, testable without megatron) or, as upstream
    verl's converters do, a ready TransformerConfig."""
    out = _lookup(MODEL_CONFIG_CONVERTER_REGISTRY, hf_config)(hf_config, dtype, **override_transformer_config)
    return build_transformer_config(out) if isinstance(out, dict) else out


def init_mcore_model(tfconfig, hf_config, pre_process: bool = True, post_process: bool = True,
                     share_embeddings_and_output_weights: Optional[bool] = None, value: bool = False,
                     vp_stage: Optional[int] = None):
    """Build one model chunk. ``share_embeddings_and_output_weights=None`` follows the checkpoint's
    ``tie_word_embeddings``; ``value=True`` swaps the LM head for a 1-output value head (critic)."""
    from verl.models.mcore import require_megatron

    require_megatron()
    build = _lookup(MODEL_INITIALIZER_REGISTRY, hf_config)
    _report_kernels(hf_config)
    return build(tfconfig, hf_config, pre_process=pre_process, post_process=post_process,
                 share_embeddings_and_output_weights=share_embeddings_and_output_weights, value=value,
                 vp_stage=vp_stage)


def _report_kernels(hf_config) -> None:
    """Say which kernels the Megatron model runs (once per process; a warning per slow fallback on CUDA), as the
    FSDP engine does when it builds its model: without fla the Gated DeltaNet layers run the torch reference."""
    import torch
    import torch.distributed as dist

    from verl.models.kernels import report_kernels
    from verl.models.spec import get_model_spec

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    report_kernels(get_model_spec(hf_config), True, on_cuda=torch.cuda.is_available(), rank0=rank0, engine="mcore")


def get_mcore_forward_fn(hf_config) -> Callable:
    return _lookup(MODEL_FORWARD_REGISTRY, hf_config)


def get_mcore_weight_converter(hf_config):
    return _lookup(MODEL_WEIGHT_CONVERTER_REGISTRY, hf_config)
