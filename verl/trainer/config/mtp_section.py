"""Checks of upstream's ``model.mtp`` section (multi-token prediction), shared by ``main_ppo`` and the SFT
trainer. What is built: loading / saving the MTP head and its training loss on the FSDP engine
(:mod:`verl.models.qwen3_5.mtp`), and speculative decoding with the head in the built-in rollout engine
(``enable_rollout`` with ``rollout.name=hf``: :mod:`verl.workers.rollout.hf_engine.speculative`). What is refused,
by key: speculative decoding anywhere else (vLLM / SGLang, the SFT trainer), MTP on the Megatron engine, and MTP on
the critic (a value model has no LM head)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["mtp_problems"]


def mtp_problems(get: Callable[[str], Any], prefix: str, strategy: str | None, value_model: bool = False) -> list[str]:
    """Problems of ``<prefix>.mtp`` (``prefix`` a model section, e.g. ``actor_rollout_ref.model``); ``get`` reads
    a dotted key (None when absent)."""
    key = f"{prefix}.mtp"
    if get(key) is None:
        return []
    problems = []
    enable = bool(get(f"{key}.enable"))
    if get(f"{key}.enable_rollout"):
        problems.extend(_rollout_problems(get, prefix, key, enable, value_model))
    scale = get(f"{key}.mtp_loss_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
        problems.append(f"`{key}.mtp_loss_scaling_factor={scale!r}` must be a number >= 0")
    if not enable:
        return problems
    if value_model:
        problems.append(f"`{key}.enable=true` on the critic: a value model has no LM head for the MTP head to "
                        "share (upstream's MTP is a policy feature); set it to false.")
    if strategy == "megatron":
        problems.append(f"`{key}.enable=true` with strategy=megatron: MTP is built on the FSDP engine only here "
                        "(Megatron's MTP block is not wired); use strategy=fsdp2, or set it to false.")
    return problems


def _rollout_problems(get, prefix: str, key: str, enable: bool, value_model: bool) -> list[str]:
    """``enable_rollout=true``: speculative decoding with the head, built for the hf rollout engine on FSDP."""
    on = f"`{key}.enable_rollout=true`"
    if value_model or not prefix.startswith("actor_rollout_ref."):
        return [f"{on}: speculative decoding is a rollout feature; this model ({prefix}) has no rollout. Set it to "
                "false."]
    problems = []
    if not enable:
        problems.append(f"{on} drafts with the checkpoint's MTP head, which `{key}.enable=true` loads; set both.")
    rollout = get("actor_rollout_ref.rollout.name")
    if rollout != "hf":
        problems.append(f"{on} with rollout.name={rollout}: speculative decoding with the MTP head is built into the "
                        "hf rollout engine only (vLLM's / SGLang's speculative config is not wired here); use "
                        "actor_rollout_ref.rollout.name=hf, or set it to false.")
    k = get(f"{key}.num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        problems.append(f"`{key}.num_speculative_tokens={k!r}` must be an integer >= 1 (draft tokens per step)")
    if get("actor_rollout_ref.rollout.enable_rollout_routing_replay"):
        problems.append(f"{on} with actor_rollout_ref.rollout.enable_rollout_routing_replay=true is not implemented "
                        "(the verification forward records no routes); set one of them to false.")
    return problems
