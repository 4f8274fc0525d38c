"""The asynchronous modes' ``main``: compose the mode's config, start two Ray resource pools (trainer, rollout)
and run :class:`~.trainer.AsyncPPOTrainer`.

The trainer pool is ``trainer.nnodes x trainer.n_gpus_per_node`` workers holding the actor (and the reference
policy, and a critic, where the algorithm needs them); the rollout pool is ``rollout.nnodes x
rollout.n_gpus_per_node`` workers holding a copy of the policy and the rollout engine. Each pool has its own
torch.distributed group; weights travel from the trainer pool's rank 0 through the controller.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from . import checks
from .schedule import fully_async_schedule, one_step_off_schedule

# mode -> (config folder, config for a real run, config for the embedded demo)
_EXPERIMENTAL = Path(__file__).resolve().parents[1]
CONFIGS = {
    "one_step_off": (_EXPERIMENTAL / "one_step_off_policy" / "config", "one_step_off_ppo_trainer",
                     "one_step_off_demo"),
    "fully_async": (_EXPERIMENTAL / "fully_async_policy" / "config", "fully_async_ppo_trainer", "fully_async_demo"),
}
SCHEDULES = {"one_step_off": one_step_off_schedule, "fully_async": fully_async_schedule}


def load_async_config(argv: list[str], mode: str, check_host: bool = False) -> DictConfig:
    """Compose (the demo variant when no model path is given and no config is named), derive, validate."""
    from verl.trainer import cli
    from verl.trainer.config.checks import compose_config
    from verl.trainer.demo import register_resolver
    from verl.trainer.main_ppo import _MODEL_KEYS
    from verl.trainer.preflight import host_problems, validate_in_order

    folder, real, demo = CONFIGS[mode]
    args = cli.parse_args(argv, main_dir=folder.parent)  # upstream's scripts pass --config-path=config
    named = any(a.startswith(("--config-name", "-cn")) for a in argv)
    name = args.config_name if named else (real if cli._sets_model_path(args.overrides) else demo)
    register_resolver()
    cfg = compose_config(name, args.overrides, config_dir=args.config_dir or folder, validate=False)
    OmegaConf.resolve(cfg)
    checks.normalize(cfg, mode)
    first = host_problems(cfg, _MODEL_KEYS, ("data.train_files", "data.val_files")) if check_host else []
    validate_in_order(cfg, first, functools.partial(checks.validate_async, mode=mode))
    return cfg


def launch_pools(cfg: DictConfig, use_critic: bool) -> dict:
    """Worker groups ``actor_rollout`` (and ``critic``) on the trainer pool, ``rollout`` on the rollout pool."""
    from verl.single_controller.ray import RayResourcePool, create_ray_worker_groups
    from verl.trainer.config.validate import need_reference_policy
    from verl.trainer.main_ppo import build_role_specs, init_ray, role_dp_layouts
    from verl.utils.device import get_device_name
    from verl.workers.engine.sections import role_dp_layout
    from verl.workers.engine_workers import ActorRolloutRefWorker

    if cfg.reward.reward_model.get("enable"):
        # The asynchronous trainers score batches on the rollout side; the reward-model worker only runs in the
        # colocated synchronous loop, so refuse rather than silently train on rule rewards.
        raise ValueError("reward.reward_model.enable=true is implemented for the synchronous trainer "
                         "(verl.trainer.main_ppo) only, not for the asynchronous modes")

    init_ray(cfg)
    device = get_device_name()
    from verl.utils.device import cpu_threads_per_worker

    threads = cpu_threads_per_worker(cfg.trainer.n_gpus_per_node + cfg.rollout.n_gpus_per_node)
    env = {"OMP_NUM_THREADS": str(threads), "VERL_CPU_THREADS": str(threads)}

    def pool(per_node: int, nnodes: int) -> RayResourcePool:
        return RayResourcePool([per_node] * nnodes, use_gpu=device != "cpu", cpus_per_worker=1,
                               device_resource="NPU" if device == "npu" else "GPU")

    specs = build_role_specs(cfg, use_critic)
    # The trainer pool's worker trains (and holds the reference): no rollout engine there.
    trainer_role = "actor_ref" if need_reference_policy(cfg) else "actor"
    specs["actor_rollout"] = (ActorRolloutRefWorker, (cfg.actor_rollout_ref, trainer_role), {"full_config": cfg})
    groups = create_ray_worker_groups(pool(cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes), specs, env=env,
                                      dp_layouts=role_dp_layouts(cfg, specs))
    rollout_world = cfg.rollout.n_gpus_per_node * cfg.rollout.nnodes
    rollout_spec = {"rollout": (ActorRolloutRefWorker, (cfg.actor_rollout_ref, "rollout"), {"full_config": cfg})}
    groups.update(create_ray_worker_groups(
        pool(cfg.rollout.n_gpus_per_node, cfg.rollout.nnodes), rollout_spec, env=env,
        dp_layouts={"rollout": role_dp_layout(cfg.actor_rollout_ref.actor, rollout_world)}))
    return groups


def run(cfg: DictConfig, mode: str) -> dict:
    from verl.trainer.main_ppo import run_ppo

    from .trainer import AsyncPPOTrainer

    schedule = SCHEDULES[mode](cfg)
    return run_ppo(cfg, launch=launch_pools, make_trainer=functools.partial(AsyncPPOTrainer, schedule=schedule),
                   prompts_per_step=schedule.prompts_per_step)


def main(mode: str, argv: list[str] | None = None) -> int:
    """The entry points' ``main``: errors the user fixes become one paragraph, as with main_ppo."""
    from verl.trainer import cli

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = cli.parse_args(argv, main_dir=CONFIGS[mode][0].parent)
        if args.help:
            print(cli.help_text(args.config_dir or CONFIGS[mode][0]))
            return 0
        if args.cfg:
            cli.print_config(load_async_config(argv, mode), args)
            return 0
        run(load_async_config(argv, mode, check_host=True), mode)
    except Exception as exc:  # noqa: BLE001 - user errors become one paragraph, bugs keep their traceback
        code = cli.report_user_error(exc)
        if code is None:
            raise
        return code
    return 0
