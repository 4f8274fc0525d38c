"""Config checks for roles on ``strategy=megatron``, run by the trainer's config validation before any worker
starts (no megatron-core needed): the engine settings, the parallel sizes against the model's heads, KV
heads, experts and layers, and features this engine does not have. Each message names the key to change."""

from __future__ import annotations

import logging
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from .settings import settings_problems

logger = logging.getLogger(__name__)

__all__ = ["megatron_problems", "parallel_size_problems"]

_DOCS = "docs/advance/megatron.md"


def _select(cfg: DictConfig, key: str, default: Any = None) -> Any:
    try:
        value = OmegaConf.select(cfg, key, default=default)
    except Exception:  # an unresolvable interpolation is reported by the generic checks
        return default
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _load_hf_config(path: Optional[str], trust_remote_code: bool = False):
    """The model's HF config when it is a local checkpoint; None otherwise (a path problem is reported by
    the model checks, and a hub id cannot be resolved here: no hub access at validation)."""
    if not path:
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable config just skips the model-dependent checks
        logger.info("megatron validation: cannot read the model config at %s (%s); skipping size checks", path, exc)
        return None


def parallel_size_problems(hf_config, section: dict, prefix: str) -> list[str]:
    """Parallel sizes of one ``*.megatron`` section against the model (``check_parallel_sizes`` of the
    model's mcore entry); a model with no Megatron entry is itself a problem."""
    try:
        from verl.models.mcore import registry
        from verl.models.mcore.config_converter import check_parallel_sizes
    except ImportError:  # pragma: no cover - the mcore model package ships with this engine
        return []
    try:
        registry.get_supported_model(hf_config)
    except (ValueError, KeyError, NotImplementedError) as exc:
        return [f"`{prefix.rsplit('.megatron', 1)[0]}.strategy=megatron`: {exc}"]
    return check_parallel_sizes(
        hf_config, tp=section.get("tensor_model_parallel_size", 1), pp=section.get("pipeline_model_parallel_size", 1),
        vpp=section.get("virtual_pipeline_model_parallel_size"), cp=section.get("context_parallel_size", 1),
        ep=section.get("expert_model_parallel_size", 1), etp=section.get("expert_tensor_parallel_size"),
        sequence_parallel=section.get("sequence_parallel"), key_prefix=prefix)


def _role_problems(cfg: DictConfig, role_key: str, model_key: str, check_model: bool = True) -> list[str]:
    section = _select(cfg, f"{role_key}.megatron") or {}
    prefix = f"{role_key}.megatron"
    problems = settings_problems(section, prefix)
    if (_select(cfg, f"{model_key}.lora_rank", 0) or 0) > 0 and role_key == "critic":
        problems.append(f"`{model_key}.lora_rank` > 0 with {role_key}.strategy=megatron: LoRA on the Megatron "
                        f"engine is built for the actor (see {_DOCS}); use strategy=fsdp2 for a LoRA critic, or set "
                        "lora_rank=0.")
    if _select(cfg, f"{model_key}.lora_adapter_path"):
        problems.append(f"`{model_key}.lora_adapter_path` with {role_key}.strategy=megatron: starting from a saved "
                        f"PEFT adapter is built on the FSDP engine only (see {_DOCS}); a Megatron LoRA run resumes "
                        "from its own checkpoint.")
    if _select(cfg, f"{model_key}.enable_router_aux_loss", False):
        problems.append(f"`{model_key}.enable_router_aux_loss=true` with {role_key}.strategy=megatron: the MoE "
                        "load-balancing loss is built on the FSDP engine only (Megatron's router trains without "
                        "it); use strategy=fsdp2, or set it to false.")
    mbridge = _select(cfg, f"{role_key}.checkpoint.mbridge_config") or {}
    if mbridge:
        problems.append(f"`{role_key}.checkpoint.mbridge_config` is not supported: this project converts "
                        "Megatron weights with its own converter, not mbridge; remove it.")
    if check_model:
        trust = bool(_select(cfg, f"{model_key}.trust_remote_code", False))
        hf_config = _load_hf_config(_select(cfg, f"{model_key}.path"), trust)
        if hf_config is not None:
            problems.extend(parallel_size_problems(hf_config, section, prefix))
    return problems


def megatron_problems(cfg: DictConfig) -> list[str]:
    """Every problem of the roles that run on ``strategy=megatron`` (empty when none does)."""
    problems: list[str] = []
    actor = "actor_rollout_ref.actor"
    if _select(cfg, f"{actor}.strategy") == "megatron":
        problems += _role_problems(cfg, actor, "actor_rollout_ref.model")
    ref = "actor_rollout_ref.ref"
    if _select(cfg, f"{ref}.strategy") == "megatron" and _select(cfg, f"{actor}.strategy") != "megatron":
        problems.append(f"`{ref}.strategy=megatron` with {actor}.strategy="
                        f"{_select(cfg, f'{actor}.strategy')!r}: the reference policy shares the actor's worker and "
                        "parallel layout; use the same strategy for both "
                        "(--config-name ppo_megatron_trainer sets both).")
    elif (_select(cfg, f"{ref}.strategy") == "megatron" and (_select(cfg, "algorithm.use_kl_in_reward", False)
                                                             or _select(cfg, f"{actor}.use_kl_loss", False))):
        # The reference engine reads its own section (its override_transformer_config follows the actor's unless
        # set, e.g. `+actor_rollout_ref.ref.megatron.override_transformer_config.<field>=...`).
        for problem in settings_problems(_select(cfg, f"{ref}.megatron") or {}, f"{ref}.megatron"):
            twin = problem.replace(f"{ref}.megatron", f"{actor}.megatron")
            if twin in problems:  # the same refusal as the actor's (a script sets both): said once, for both
                said = twin.split(" ", 1)
                problems[problems.index(twin)] = f"{said[0]} (and the same under {ref}.megatron) {said[1]}"
            else:
                problems.append(problem)
    critic_used = _select(cfg, "critic.enable")
    if critic_used is None:
        critic_used = _select(cfg, "algorithm.adv_estimator") == "gae"
    if critic_used and _select(cfg, "critic.strategy") == "megatron":
        problems += _role_problems(cfg, "critic", "critic.model")
    return list(dict.fromkeys(problems))
