"""Config rules of the asynchronous modes, on top of the trainer's ``validate_config``.

Each upstream key of the async configs either does what upstream's does here or is refused naming it.
:func:`normalize` fills the values these modes derive (upstream's fully-async scripts pass
``data.train_batch_size=0``: a trainer step consumes ``require_batches * ppo_mini_batch_size`` prompts).
"""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

from verl.trainer.config.checker import ConfigValidationError

MODES = ("one_step_off", "fully_async")


def normalize(cfg: DictConfig, mode: str) -> None:
    if mode != "fully_async":
        return
    at = cfg.async_training
    per_step = int(at.require_batches) * int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    with open_dict(cfg):
        cfg.data.train_batch_size = per_step
        total = cfg.rollout.get("total_rollout_steps")
        # rollout.total_rollout_steps counts prompts to generate: it sets the number of trainer steps unless
        # trainer.total_training_steps does.
        if total is not None and not cfg.trainer.get("total_training_steps"):
            cfg.trainer.total_training_steps = max(1, int(total) // per_step)


def async_problems(cfg: DictConfig, mode: str) -> list[str]:
    problems = []
    if mode not in MODES:
        problems.append(f"unknown asynchronous mode {mode!r} (one of {MODES})")
    arr = cfg.actor_rollout_ref
    if cfg.trainer.get("launcher", "ray") != "ray":
        problems.append("trainer.launcher: the asynchronous modes run two Ray resource pools; set trainer.launcher=ray")
    if arr.actor.get("strategy") == "megatron" and arr.rollout.name == "hf":
        # The built-in engine generates with a training engine's module: on a rollout pool of its own that would be
        # a Megatron engine whose HF copy is refreshed from its own (never trained) chunks.
        problems.append("actor_rollout_ref.rollout.name=hf with actor_rollout_ref.actor.strategy=megatron: the "
                        "asynchronous modes' rollout pool runs the built-in engine on an FSDP copy of the policy "
                        "only; use rollout.name=vllm with a Megatron trainer (as upstream's scripts do)")
    for key in ("nnodes", "n_gpus_per_node"):
        value = cfg.rollout.get(key)
        if not isinstance(value, int) or value < 1:
            problems.append(f"rollout.{key}={value!r}: the rollout pool's size must be a positive integer")
    if int(arr.model.get("lora_rank", 0) or 0) > 0:
        problems.append("actor_rollout_ref.model.lora_rank: the asynchronous modes sync full weights; LoRA is not "
                        "supported there")
    if arr.rollout.get("multi_turn", {}).get("enable", False):
        problems.append("actor_rollout_ref.rollout.multi_turn.enable: agent loops are not run by the asynchronous "
                        "rollouter yet")
    fg = cfg.algorithm.get("filter_groups")
    if fg is not None and fg.get("enable", False):
        problems.append("algorithm.filter_groups.enable: dynamic sampling is not supported in the asynchronous modes")
    if cfg.algorithm.adv_estimator == "remax":
        problems.append("algorithm.adv_estimator=remax: its greedy baseline generates on the trainer pool, which "
                        "has no rollout in the asynchronous modes")
    if mode == "fully_async":
        problems += _fully_async_problems(cfg)
    return problems


def _fully_async_problems(cfg: DictConfig) -> list[str]:
    at = cfg.async_training
    problems = []
    if float(at.staleness_threshold) < 0:
        problems.append(f"async_training.staleness_threshold={at.staleness_threshold}: must be >= 0")
    for key in ("trigger_parameter_sync_step", "require_batches"):
        if int(at[key]) < 1:
            problems.append(f"async_training.{key}={at[key]}: must be >= 1")
    if at.get("partial_rollout", False):
        arr = cfg.actor_rollout_ref
        mtp = arr.model.get("mtp") or {}
        if mtp.get("enable", False) and mtp.get("enable_rollout", False):
            problems.append("async_training.partial_rollout=True with actor_rollout_ref.model.mtp.enable_rollout=true: "
                            "continuing speculative decoding across a weight update is not implemented (set one "
                            "of them to false)")
        if arr.rollout.get("enable_rollout_routing_replay", False):
            problems.append("async_training.partial_rollout=True with "
                            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true: a response continued "
                            "across a weight update would mix two versions' routes (set one of them to false)")
    if at.get("use_trainer_do_validate", False):
        problems.append("async_training.use_trainer_do_validate=True: validation runs on the rollout pool here "
                        "(between chunks, on the newest synced weights); set it to False")
    if at.get("use_dynamic_resource_scheduling", False):
        problems.append("async_training.use_dynamic_resource_scheduling=True: hybrid replicas on the trainer pool "
                        "are not implemented; set it to False")
    per_replica = at.get("concurrent_samples_per_replica", 16)
    if isinstance(per_replica, bool) or not isinstance(per_replica, int) or per_replica < 1:
        problems.append(f"async_training.concurrent_samples_per_replica={per_replica!r}: must be an integer >= 1 "
                        "(prompts in generation at once per rollout replica)")
    return problems


def validate_async(cfg: DictConfig, mode: str) -> None:
    """``validate_config`` and the rules above, reported together."""
    from verl.trainer.config.checks import validate_config

    problems: list[str] = []
    try:
        validate_config(cfg)
    except ConfigValidationError as err:
        problems += err.problems
    problems += async_problems(cfg, mode)
    if problems:
        raise ConfigValidationError(problems)
