"""Entry point: ``python -m verl.trainer.main_ppo [--config-name NAME] [key=value ...]``.

Overrides use Hydra's grammar, as with upstream verl. Every override key is checked before composing (an
unknown key names the nearest valid one), the composed config is validated before any worker starts,
then the workers are launched (Ray, or in-process with ``trainer.launcher=local``) and the trainer runs.
With no arguments at all it runs the embedded demo (``--config-name demo``).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

logger = logging.getLogger(__name__)


def parse_cli(argv: list[str]) -> tuple[str, Path | None, list[str]]:
    """Split ``--config-name/--config-path`` (Hydra's flags) from key=value overrides."""
    name, path, rest = None, None, []
    i = 0
    while i < len(argv):
        a = argv[i]
        for flag in ("--config-name", "--config-path", "-cn", "-cp"):
            if a == flag or a.startswith(flag + "="):
                if a == flag:
                    if i + 1 >= len(argv):
                        raise SystemExit(f"{flag} needs a value")
                    val = argv[i + 1]
                    i += 1
                else:
                    val = a.split("=", 1)[1]
                if flag in ("--config-name", "-cn"):
                    name = val
                else:
                    path = Path(val).expanduser().resolve()
                break
        else:
            rest.append(a)
        i += 1
    if name is None:
        name = "demo" if not argv else "ppo_trainer"
    return name, path, rest


def load_config(argv: list[str]) -> DictConfig:
    from verl.trainer.config.checks import compose_config
    from verl.trainer.demo import register_resolver

    register_resolver()
    name, path, overrides = parse_cli(argv)
    cfg = compose_config(name, overrides, config_dir=path, validate=False)
    OmegaConf.resolve(cfg)
    from verl.trainer.config.checks import validate_config

    validate_config(cfg)
    return cfg


def _set_total_steps(cfg: DictConfig, total: int) -> None:
    with open_dict(cfg):
        cfg.actor_rollout_ref.actor.optim.total_training_steps = total
        if "critic" in cfg and "optim" in cfg.critic:
            cfg.critic.optim.total_training_steps = total


def build_role_specs(cfg: DictConfig, use_critic: bool) -> dict:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine_workers import ActorRolloutRefWorker, CriticWorker

    # Fail here, before any worker starts, if a role's engine is unknown or its optional extra is missing.
    EngineRegistry.get_or_raise(cfg.actor_rollout_ref.actor.strategy)
    if use_critic:
        EngineRegistry.get_or_raise(cfg.critic.strategy)
    specs = {"actor_rollout": (ActorRolloutRefWorker, (cfg.actor_rollout_ref, "actor_rollout_ref"),
                               {"full_config": cfg})}
    if use_critic:
        # critic.rollout_n already interpolates actor_rollout_ref.rollout.n in the config.
        specs["critic"] = (CriticWorker, (cfg.critic,), {})
    return specs


def role_dp_sizes(cfg: DictConfig, specs: dict) -> dict[str, int]:
    """Data-parallel size of each role: the world size divided by the role's Ulysses sequence-parallel size
    (the actor's for the actor/rollout/ref worker, the critic's for the critic): the ranks of one SP group all
    receive the same data."""
    from verl.workers.engine_workers import ActorRolloutRefWorker, ranks_per_dp_replica

    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    actor_sp = ranks_per_dp_replica(cfg.actor_rollout_ref.actor)
    critic_sp = ranks_per_dp_replica(cfg.get("critic") or {})
    return {role: world // (actor_sp if issubclass(spec[0], ActorRolloutRefWorker) else critic_sp)
            for role, spec in specs.items()}


def launch_workers(cfg: DictConfig, specs: dict) -> dict:
    from verl.utils.device import get_device_name

    launcher = cfg.trainer.get("launcher", "ray")
    device = get_device_name()
    if launcher == "local":
        from verl.single_controller.worker_group import create_local_worker_groups

        world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
        if world != 1:
            raise ValueError(f"trainer.launcher=local runs one process; set trainer.n_gpus_per_node=1 (got world {world})")
        return create_local_worker_groups(specs, dp_sizes=role_dp_sizes(cfg, specs))
    import ray

    from verl.single_controller.ray import RayResourcePool, create_ray_worker_groups

    if not ray.is_initialized():
        init_kwargs = OmegaConf.to_container(cfg.ray_kwargs.get("ray_init", {}), resolve=True) or {}
        init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None}
        init_kwargs.setdefault("include_dashboard", False)
        init_kwargs.setdefault("log_to_driver", True)
        init_kwargs.setdefault("logging_level", logging.WARNING)
        env = {"TOKENIZERS_PARALLELISM": "true", "RAY_DEDUP_LOGS": "1"}
        runtime_env = init_kwargs.setdefault("runtime_env", {})
        runtime_env.setdefault("env_vars", {}).update({**env, **runtime_env.get("env_vars", {})})
        try:
            ray.init(**init_kwargs)
        except Exception as e:  # noqa: BLE001 - Ray raises many types; re-raise with the cause named
            raise RuntimeError(f"Ray failed to start with ray_kwargs.ray_init={init_kwargs}: {e}. "
                               "Set trainer.launcher=local to run a single device without Ray.") from e
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    on_cpu = device == "cpu"
    threads = int(os.environ.get("VERL_CPU_THREADS", "1"))
    pool = RayResourcePool([cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes, use_gpu=not on_cpu,
                           cpus_per_worker=1, device_resource="NPU" if device == "npu" else "GPU")
    env = {"OMP_NUM_THREADS": str(threads), "VERL_CPU_THREADS": str(threads)}
    return create_ray_worker_groups(pool, specs, env=env, dp_sizes=role_dp_sizes(cfg, specs))


def run_ppo(cfg: DictConfig) -> dict:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.dataset.rl_dataset import collate_fn, create_rl_dataset
    from verl.utils.tracking import Tracking
    from verl.utils.tokenizer import load_tokenizer_and_processor

    from transformers import AutoConfig

    from verl.utils.tokenizer import local_model_path

    tokenizer, processor = load_tokenizer_and_processor(cfg.actor_rollout_ref.model)
    # The dataset needs the model config for Qwen3.5-VL mRoPE position ids.
    hf_config = AutoConfig.from_pretrained(local_model_path(cfg.actor_rollout_ref.model),
                                           trust_remote_code=bool(cfg.actor_rollout_ref.model.get("trust_remote_code")))
    train_ds = create_rl_dataset(cfg.data.train_files, cfg.data, tokenizer, processor, is_train=True,
                                 model_config=hf_config)
    val_ds = create_rl_dataset(cfg.data.val_files, cfg.data, tokenizer, processor, is_train=False,
                               model_config=hf_config) if cfg.data.get("val_files") else None
    reward_fn = load_reward_manager(cfg, tokenizer, num_examine=0, **(cfg.reward.get("reward_kwargs") or {}))
    val_reward_fn = load_reward_manager(cfg, tokenizer, num_examine=1, **(cfg.reward.get("reward_kwargs") or {}))
    use_critic = cfg.algorithm.adv_estimator == "gae"
    steps_per_epoch = len(train_ds) // cfg.data.train_batch_size
    total = cfg.trainer.get("total_training_steps") or steps_per_epoch * cfg.trainer.total_epochs
    _set_total_steps(cfg, int(total))
    groups = launch_workers(cfg, build_role_specs(cfg, use_critic))
    for wg in groups.values():
        wg.init_model()
    trainer = RayPPOTrainer(cfg, tokenizer, groups, train_ds, val_ds, collate_fn, reward_fn, val_reward_fn,
                            processor=processor)
    tracker = Tracking(cfg.trainer.project_name, cfg.trainer.experiment_name, default_backend=list(cfg.trainer.logger),
                       config=OmegaConf.to_container(cfg, resolve=True))
    try:
        result = trainer.fit(tracker)
    finally:
        tracker.finish()
    curve = plot_reward_curve(result.get("history", []) if isinstance(result, dict) else [], cfg)
    if curve:
        print(f"Reward curve written to {curve}", flush=True)
    return result


def plot_reward_curve(history: list[dict], cfg: DictConfig) -> str | None:
    """PNG of critic/score/mean per step (and validation score where measured) next to the checkpoints."""
    steps = [h["training/global_step"] for h in history if "critic/score/mean" in h]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [h["critic/score/mean"] for h in history if "critic/score/mean" in h]
    out_dir = os.path.abspath(os.path.expanduser(cfg.trainer.default_local_dir))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "reward_curve.png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, scores, marker="o", ms=3, label="critic/score/mean (train)")
    val = [(h["training/global_step"], v) for h in history for k, v in h.items()
           if k.startswith("val-core/") and k.endswith("/mean@1")]
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "s--", ms=4, label="val-core mean@1 (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_title(f"{cfg.trainer.project_name} / {cfg.trainer.experiment_name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from verl.trainer.config.checks import ConfigKeyError, ConfigValidationError

    try:
        cfg = load_config(argv)
    except (ConfigKeyError, ConfigValidationError) as e:
        print(f"Config error:\n{e}", file=sys.stderr)
        return 2
    run_ppo(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
