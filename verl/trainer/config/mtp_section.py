"""Checks of upstream's ``model.mtp`` section (multi-token prediction), shared by ``main_ppo`` and the SFT
trainer. What is built: loading / saving the MTP head and its training loss on the FSDP engine
(:mod:`verl.models.qwen3_5.mtp`). What is refused, by key: speculative decoding with the head
(``enable_rollout``), MTP on the Megatron engine, and MTP on the critic (a value model has no LM head)."""

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
        problems.append(f"`{key}.enable_rollout=true`: speculative decoding with the MTP head is not implemented "
                        "here (neither the built-in hf engine nor the vLLM rollout is given a draft model); the "
                        "MTP head can be loaded, trained and saved (mtp.enable / mtp.enable_train). Set it to false.")
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
