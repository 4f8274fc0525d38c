"""Actor -> rollout engine weight synchronisation (engine-agnostic, no vLLM import).

The worker calls, after each actor update::

    layout = get_model_spec(hf_config).resolve("weight_sync_layout").from_hf_config(hf_config)
    rollout.update_weights(iter_hf_weights(actor_module, bucket_megabytes=..., layered=..., dtype=...))

and the engine checks the result with :func:`check_coverage`.
"""

from .coverage import WeightCoverageError, check_coverage, check_loader_coverage
from .gather import full_tensor, iter_hf_weight_buckets, iter_hf_weights
from .lora import check_engine_lora_targets, check_lora_config, engine_lora_module, write_lora_adapter
from .names import (
    EngineLayout,
    engine_targets,
    expand_fused_experts,
    expected_engine_names,
    required_shards,
    strip_wrapper_names,
    to_engine_loader_format,
)

__all__ = [
    "EngineLayout",
    "WeightCoverageError",
    "check_coverage",
    "check_loader_coverage",
    "check_engine_lora_targets",
    "check_lora_config",
    "engine_lora_module",
    "engine_targets",
    "expand_fused_experts",
    "expected_engine_names",
    "full_tensor",
    "iter_hf_weight_buckets",
    "iter_hf_weights",
    "required_shards",
    "strip_wrapper_names",
    "to_engine_loader_format",
    "write_lora_adapter",
]
