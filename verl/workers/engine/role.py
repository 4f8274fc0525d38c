"""What an engine's role asks of it: which output head the model has and what it returns, whether it trains.

Engines read these fields instead of comparing role names: a new role (a reward model, say) is one
registration here, not a branch in each engine. ``BaseEngine.role`` stays the name (checkpoint layouts, logs);
``BaseEngine.role_spec`` is the :class:`EngineRole`.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.utils.registry import Registry

__all__ = ["ENGINE_ROLES", "EngineRole", "engine_role", "register_engine_role"]


@dataclass(frozen=True)
class EngineRole:
    name: str
    # "lm": the causal-LM head, outputs next-token ``log_probs`` (and ``entropy``); "value": a one-output value
    # head in place of the LM head (fresh at load), outputs ``values``; "score": a sequence-classification
    # checkpoint's trained score head (a reward model), outputs its per-token scores as ``values``.
    head: str
    trainable: bool  # optimizer, scheduler and checkpoints
    model_section: str  # where the user sets this role's model (messages name it)
    section: str  # the role's own config section (engine settings live under it, e.g. ``<section>.megatron``)
    lora: bool = False  # LoRA adapters wrap this role's model when the model section enables them

    @property
    def value_head(self) -> bool:
        return self.head in ("value", "score")

    @property
    def output(self) -> str:
        """The per-token output a loss of this role reads."""
        return "values" if self.value_head else "log_probs"

    @property
    def multimodal(self) -> bool:
        """Whether image/video inputs reach the model (the value model runs on the text tokens only)."""
        return not self.value_head


ENGINE_ROLES = Registry("engine role")


def register_engine_role(role: EngineRole, override: bool = False) -> EngineRole:
    return ENGINE_ROLES.register(role.name, role, override=override)


def engine_role(name: str) -> EngineRole:
    return ENGINE_ROLES.get_or_raise(name)


for _role in (
    EngineRole("actor", "lm", True, "actor_rollout_ref.model", "actor_rollout_ref.actor", lora=True),
    EngineRole("ref", "lm", False, "actor_rollout_ref.model", "actor_rollout_ref.ref"),
    # A rollout pool's own copy of the policy (asynchronous modes): frozen, in the actor's engine settings,
    # its weights replaced by each sync from the trainer pool.
    EngineRole("rollout", "lm", False, "actor_rollout_ref.model", "actor_rollout_ref.actor"),
    EngineRole("critic", "value", True, "critic.model", "critic"),
    # A discriminative reward model (reward.reward_model.*): frozen, scores every token with its score head.
    EngineRole("reward_model", "score", False, "reward.reward_model.model_path", "reward.reward_model"),
    # A generative reward model (the judge of reward.reward_model.* with a custom reward function): a frozen
    # causal LM the built-in rollout engine generates verdicts with.
    EngineRole("genrm", "lm", False, "reward.reward_model.model_path", "reward.reward_model"),
    # The on-policy distillation teacher: frozen like the reference and run with the reference's engine settings
    # (strategy, fsdp_config / megatron, micro-batching), its checkpoint named by the distillation section.
    EngineRole("teacher", "lm", False, "distillation.teacher_models.teacher_model", "actor_rollout_ref.ref"),
    # SFT runs the actor's engine settings (its trainer maps its own keys onto them).
    EngineRole("sft", "lm", True, "actor_rollout_ref.model", "actor_rollout_ref.actor", lora=True),
):
    register_engine_role(_role)
