"""Upstream's newer LoRA section (``<model>.lora.*``) as an alias of the flat LoRA keys the workers read.

Upstream verl grew ``model.lora`` (``rank``, ``alpha``, ``target_modules``, ``merge`` ...) next to the older flat
``model.lora_rank`` / ``lora_alpha`` / ``target_modules``. Here every reader keeps reading the flat keys: after
composition :func:`settle_lora_section` copies each set (non-null) section value to its flat key, so the two
spellings cannot disagree at run time. A flat key changed from its default to a different value than the
section's is left alone for validation to refuse (:func:`lora_section_conflicts`). ``lora.merge`` has no flat twin;
the LoRA weight sync reads it (verl/workers/lora.py).
"""

from __future__ import annotations

import warnings
from typing import Any

from omegaconf import OmegaConf, open_dict

__all__ = ["LORA_SECTION_ALIASES", "MODEL_SECTIONS", "lora_section_conflicts", "settle_lora_section"]

# section key -> (flat key, the flat key's YAML default)
LORA_SECTION_ALIASES: dict[str, tuple[str, Any]] = {
    "rank": ("lora_rank", 0),
    "alpha": ("lora_alpha", 16),
    "dropout": ("lora_dropout", 0.0),
    "target_modules": ("target_modules", "all-linear"),
    "exclude_modules": ("exclude_modules", None),
    "adapter_path": ("lora_adapter_path", None),
}
MODEL_SECTIONS = ("actor_rollout_ref.model", "critic.model", "model")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _pairs(cfg: Any):
    """(model section path, section node, section key, flat key, flat default, section value, flat value)."""
    for path in MODEL_SECTIONS:
        model = OmegaConf.select(cfg, path, default=None)
        if not OmegaConf.is_config(model) or not OmegaConf.is_config(model.get("lora")):
            continue
        for key, (flat, default) in LORA_SECTION_ALIASES.items():
            value = _plain(model.lora.get(key))
            if value is not None:
                yield path, model, key, flat, default, value, _plain(model.get(flat))


def lora_section_conflicts(cfg: Any) -> list[tuple[str, str]]:
    """``(section key, flat key)`` pairs set to different values (both changed from their defaults)."""
    return [(f"{path}.lora.{key}", f"{path}.{flat}") for path, _, key, flat, default, value, current in _pairs(cfg)
            if current != value and current != default]


def settle_lora_section(cfg: Any) -> None:
    """Copy every set ``<model>.lora.<key>`` to its flat key (where the flat key is still at its default)."""
    for _, model, _, flat, default, value, current in list(_pairs(cfg)):
        if current == default:
            with open_dict(model):
                model[flat] = value
    _megatron_actor_merges(cfg)


def _megatron_actor_merges(cfg: Any) -> None:
    """A LoRA actor on the Megatron engine hands the rollout merged weights (its adapters live on megatron-core's
    tensor-parallel linears, which no rollout engine loads as adapters), so ``lora.merge`` is true there: the
    rollout engine is then built without LoRA, as upstream's is under ``merge=True``."""
    if OmegaConf.select(cfg, "actor_rollout_ref.actor.strategy", default=None) != "megatron":
        return
    model = OmegaConf.select(cfg, "actor_rollout_ref.model", default=None)
    if not OmegaConf.is_config(model) or int(_plain(model.get("lora_rank")) or 0) <= 0:
        return
    if _plain(OmegaConf.select(model, "lora.merge", default=None)) is False:
        warnings.warn("actor_rollout_ref.model.lora.merge=false with actor.strategy=megatron: the Megatron engine "
                      "syncs merged weights to the rollout (merge=true); separate adapters are built on the FSDP "
                      "engine only", stacklevel=2)
    with open_dict(model):
        if not OmegaConf.is_config(model.get("lora")):
            model.lora = {}
        model.lora.merge = True
