"""The Megatron engine's settings: the ``*.megatron`` config section read once, checked, with every key that
this engine cannot honour refused by name. Imports without megatron-core (config validation uses it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from verl.utils.config import cfg_get, to_plain

__all__ = ["MIN_MCORE_VERSION", "MegatronSettings", "require_mcore", "settings_problems", "read_settings"]

MIN_MCORE_VERSION = (0, 18)

_INSTALL_HINT = ("strategy=megatron needs megatron-core >= {v} (Python 3.12, CUDA). Install the extra: "
                 "`pip install -e .[mcore]`.")


def require_mcore() -> None:
    """Import megatron-core or raise an ImportError that names the ``mcore`` extra."""
    want = ".".join(map(str, MIN_MCORE_VERSION))
    try:
        import megatron.core as mcore  # noqa: F401
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT.format(v=want) + f" ({exc})") from exc
    version = getattr(mcore, "__version__", "0.0")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_MCORE_VERSION:
        raise ImportError(_INSTALL_HINT.format(v=want) + f" Found megatron-core {version}.")


# Declined on purpose, like the VeOmni and Megatron-lite engines: one way to shard parameters over data-parallel ranks.
_MEGATRON_FSDP = ("Megatron-FSDP is left out on purpose: sharding parameters over the data-parallel ranks is the "
                  "fsdp2 strategy's job here (torch FSDP2), and the Megatron engine shards the optimizer state with "
                  "use_distributed_optimizer=true (its default); use one of those")

# Keys whose only supported value is the default: anything else is refused with the reason.
_ONLY_DEFAULT = {
    "use_megatron_fsdp": (False, _MEGATRON_FSDP),
    "dynamic_context_parallel": (False, "dynamic context parallelism is not built here"),
    "override_mcore_model_config": ({}, "there is no bridge model config here; put TransformerConfig fields "
                                        "in override_transformer_config"),
    "dist_checkpointing_prefix": ("", "dist checkpoints are written and read without a key prefix here"),
}
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


@dataclass
class MegatronSettings:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    sequence_parallel: bool = True
    use_distributed_optimizer: bool = True
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None
    use_remove_padding: bool = True
    forward_only: bool = False
    dtype: str = "bfloat16"
    seed: int = 42
    override_transformer_config: dict = field(default_factory=dict)
    override_ddp_config: dict = field(default_factory=dict)
    entropy_chunking: bool = False
    entropy_chunk_size: int = 2048

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp


def _get(section: Mapping, key: str, default: Any = None) -> Any:
    return to_plain(cfg_get(section, key, default))


def settings_problems(section: Mapping, prefix: str = "actor_rollout_ref.actor.megatron") -> list[str]:
    """Every reason this engine cannot run ``section`` as given; each names the key to change."""
    problems = []
    for key, (default, why) in _ONLY_DEFAULT.items():
        value = _get(section, key)
        if value not in (None, default):
            problems.append(f"{prefix}.{key}={value!r} is not supported: {why}.")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size"):
        value = _get(section, key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{prefix}.{key} must be a positive integer (got {value!r}).")
    for key in ("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size"):
        value = _get(section, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems.append(f"{prefix}.{key} must be null or a positive integer (got {value!r}).")
    cp = _get(section, "context_parallel_size", 1)
    if isinstance(cp, int) and cp > 1 and _get(section, "use_remove_padding", True) is False:
        # The CP layout cuts packed sequences (THD); a padded (B, L) batch has no sequence boundaries to cut at.
        problems.append(f"{prefix}.context_parallel_size={cp} needs packed sequences: set "
                        f"{prefix}.use_remove_padding=true (or context_parallel_size=1).")
    vpp = _get(section, "virtual_pipeline_model_parallel_size")
    if isinstance(vpp, int) and vpp > 1 and _get(section, "pipeline_model_parallel_size", 1) < 2:
        problems.append(f"{prefix}.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1; "
                        "set it to null.")
    dtype = str(_get(section, "dtype", "bfloat16"))
    if dtype not in _DTYPES:
        problems.append(f"{prefix}.dtype={dtype!r} is not supported; use bfloat16 or float32 "
                        "(float16 would need a loss scaler this engine does not build).")
    from .config_fields import DDP_CONFIG, TRANSFORMER_CONFIG, unknown_fields

    for key, kind in (("override_transformer_config", TRANSFORMER_CONFIG), ("override_ddp_config", DDP_CONFIG)):
        value = _get(section, key, {})
        if value is not None and not isinstance(value, dict):
            problems.append(f"{prefix}.{key} must be a mapping (got {type(value).__name__}).")
        elif value:  # free-form as upstream: any field of megatron-core's dataclass, a misspelt one by name
            problems.extend(unknown_fields(value, kind, f"{prefix}.{key}"))
    ddp = _get(section, "override_ddp_config", {}) or {}
    if isinstance(ddp, dict):
        for key in ("use_megatron_fsdp", "use_custom_fsdp"):
            if ddp.get(key):
                problems.append(f"{prefix}.override_ddp_config.{key} is not supported: {_MEGATRON_FSDP}.")
    if _get(section, "use_dist_checkpointing", False) is False and _get(section, "dist_checkpointing_path"):
        problems.append(f"{prefix}.dist_checkpointing_path is set but use_dist_checkpointing is false; "
                        "set use_dist_checkpointing=true to start from that checkpoint, or drop the path.")
    return problems


def read_settings(section: Mapping, model_use_remove_padding: Optional[bool] = None,
                  prefix: str = "actor_rollout_ref.actor.megatron") -> MegatronSettings:
    """``section`` (a ``*.megatron`` config) -> :class:`MegatronSettings`; raises ValueError on any problem.

    ``model_use_remove_padding`` is ``model.use_remove_padding``, the deprecated alias of the engine's
    ``use_remove_padding``: it applies only when explicitly false (both default to true)."""
    problems = settings_problems(section, prefix)
    if problems:
        raise ValueError("Megatron engine settings:\n  - " + "\n  - ".join(problems))
    tp = int(_get(section, "tensor_model_parallel_size", 1))
    remove_padding = bool(_get(section, "use_remove_padding", True))
    if model_use_remove_padding is False:
        remove_padding = False
    overrides = dict(_get(section, "override_transformer_config", {}) or {})
    return MegatronSettings(
        tp=tp,
        pp=int(_get(section, "pipeline_model_parallel_size", 1)),
        vpp=_get(section, "virtual_pipeline_model_parallel_size"),
        cp=int(_get(section, "context_parallel_size", 1)),
        ep=int(_get(section, "expert_model_parallel_size", 1)),
        etp=_get(section, "expert_tensor_parallel_size"),
        # Sequence parallelism shards activations over the TP group, so it means nothing at TP 1
        # (and megatron-core rejects it there).
        sequence_parallel=bool(_get(section, "sequence_parallel", True)) and tp > 1,
        use_distributed_optimizer=bool(_get(section, "use_distributed_optimizer", True)),
        param_offload=bool(_get(section, "param_offload", False)),
        grad_offload=bool(_get(section, "grad_offload", False)),
        optimizer_offload=bool(_get(section, "optimizer_offload", False)),
        use_dist_checkpointing=bool(_get(section, "use_dist_checkpointing", False)),
        dist_checkpointing_path=_get(section, "dist_checkpointing_path"),
        use_remove_padding=remove_padding,
        forward_only=bool(_get(section, "forward_only", False)),
        dtype=_DTYPES[str(_get(section, "dtype", "bfloat16"))],
        seed=int(_get(section, "seed", 42)),
        override_transformer_config={k: v for k, v in overrides.items()},
        override_ddp_config=dict(_get(section, "override_ddp_config", {}) or {}),
        entropy_chunking=bool(_get(section, "entropy_from_logits_with_chunking", False)),
        entropy_chunk_size=int(_get(section, "entropy_from_logits_chunk_size", 2048)),
    )
