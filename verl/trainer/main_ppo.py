"""Entry point: ``python -m verl.trainer.main_ppo [--config-path DIR] [--config-name NAME] [key=value ...]``.

Overrides use Hydra's grammar, as with upstream verl. Every override key is checked before composing (an
unknown key names the nearest valid one), the composed config is validated before any worker starts,
then the workers are launched (Ray, or in-process with ``trainer.launcher=local``) and the trainer runs.
Without a model path it runs the embedded demo (``--config-name demo``) with the given overrides;
``--cfg job`` prints the composed config and runs nothing; ``--help`` lists the config groups
(:mod:`verl.trainer.cli`).
"""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig, OmegaConf, open_dict

logger = logging.getLogger(__name__)


def load_config(argv: list[str], resolve: bool = True) -> DictConfig:
    """Compose ``argv`` (checking every override key), resolve and validate it."""
    from verl.trainer.cli import parse_args

    return _load(parse_args(argv), resolve=resolve)


def _load(args, resolve: bool = True, check_host: bool = False) -> DictConfig:
    """Compose and validate; ``check_host`` (a real run) first checks the model path and data files, and
    lists what is missing there before any batch-size problem (verl/trainer/preflight.py)."""
    from verl.trainer.config.checks import compose_config, validate_config
    from verl.trainer.demo import register_resolver
    from verl.trainer.preflight import host_problems, validate_in_order

    register_resolver()
    cfg = compose_config(args.config_name, args.overrides, config_dir=args.config_dir, validate=False)
    if resolve:
        OmegaConf.resolve(cfg)
    model_keys = _MODEL_KEYS
    if OmegaConf.select(cfg, "distillation.enabled", default=False):  # the teacher checkpoint too
        model_keys = (*_MODEL_KEYS, "distillation.teacher_models.teacher_model.model_path")
    first = host_problems(cfg, model_keys, ("data.train_files", "data.val_files")) if check_host else []
    validate_in_order(cfg, first, validate_config)
    return cfg


# The checkpoints a run loads (the critic's and the reward model's paths are checked by their loaders).
_MODEL_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path")


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
    from verl.trainer.ppo.genrm import GENRM_ROLE, is_generative

    if is_generative(cfg):
        from verl.workers.reward_model.genrm_worker import GenerativeRewardModelWorker

        # Colocated like the discriminative model: the judge's FSDP2 shards and its built-in rollout on every rank;
        # the controller's router sends it the custom reward function's chat requests.
        specs[GENRM_ROLE] = (GenerativeRewardModelWorker, (cfg.reward.reward_model,), {})
    elif need_reward_model(cfg):
        from verl.workers.reward_model.worker import RewardModelWorker

        # Colocated: one reward-model worker per rank of the same pool (upstream's default, enable_resource_pool
        # false); it scores each generated batch before the reward managers run.
        specs["reward_model"] = (RewardModelWorker, (cfg.reward.reward_model, cfg.actor_rollout_ref.model), {})
    return specs


def need_reward_model(cfg: DictConfig) -> bool:
    return bool(OmegaConf.select(cfg, "reward.reward_model.enable", default=False))


def role_dp_layouts(cfg: DictConfig, specs: dict) -> dict:
    """Which data-parallel replica each rank serves, per role (``DataParallelLayout``): the actor/rollout/ref
    worker follows the actor section's engine, the critic its own (a Ulysses group, or a Megatron model-parallel
    replica laid out pipeline-outermost); every rank of one replica receives the same data."""
    from verl.single_controller.dp_layout import DataParallelLayout
    from verl.workers.engine.sections import role_dp_layout
    from verl.workers.engine_workers import ActorRolloutRefWorker

    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    from verl.trainer.ppo.genrm import GENRM_ROLE

    layouts = {}
    for role, spec in specs.items():
        if role in ("reward_model", GENRM_ROLE):  # no model parallelism: every rank scores its own share
            layouts[role] = DataParallelLayout.blocks(world)
        elif issubclass(spec[0], ActorRolloutRefWorker):
            layouts[role] = role_dp_layout(cfg.actor_rollout_ref.actor, world)
        else:
            layouts[role] = role_dp_layout(cfg.get("critic") or {}, world)
    return layouts


def launch_workers(cfg: DictConfig, specs: dict) -> dict:
    from verl.utils.device import get_device_name

    launcher = cfg.trainer.get("launcher", "ray")
    device = get_device_name()
    if launcher == "local":
        from verl.single_controller.worker_group import create_local_worker_groups

        world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
        if world != 1:
            raise ValueError(f"trainer.launcher=local runs one process; set trainer.n_gpus_per_node=1 (got world {world})")
        return create_local_worker_groups(specs, dp_layouts=role_dp_layouts(cfg, specs))
    from verl.single_controller.ray import RayResourcePool, create_ray_worker_groups

    init_ray(cfg)
    on_cpu = device == "cpu"
    from verl.utils.device import cpu_threads_per_worker

    threads = cpu_threads_per_worker(cfg.trainer.n_gpus_per_node)
    pool = RayResourcePool([cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes, use_gpu=not on_cpu,
                           cpus_per_worker=1, device_resource="NPU" if device == "npu" else "GPU")
    env = {"OMP_NUM_THREADS": str(threads), "VERL_CPU_THREADS": str(threads)}
    return create_ray_worker_groups(pool, specs, env=env, dp_layouts=role_dp_layouts(cfg, specs))


def init_ray(cfg: DictConfig) -> None:
    """Start Ray with ``ray_kwargs.ray_init`` (once per process)."""
    import ray

    if not ray.is_initialized():
        init_kwargs = OmegaConf.to_container(cfg.ray_kwargs.get("ray_init", {}), resolve=True) or {}
        init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None}
        init_kwargs.setdefault("include_dashboard", False)
        init_kwargs.setdefault("log_to_driver", True)
        init_kwargs.setdefault("logging_level", logging.WARNING)
        env = {"TOKENIZERS_PARALLELISM": "true", "RAY_DEDUP_LOGS": "1"}
        # runtime_env (py_executable, env_vars, ...) goes to Ray as given; unset (null) fields are left out.
        runtime_env = {k: v for k, v in (init_kwargs.get("runtime_env") or {}).items() if v is not None}
        init_kwargs["runtime_env"] = runtime_env
        # Ray takes only strings for env_vars, while Hydra types `...env_vars.VLLM_USE_V1=1` as an int.
        user_env = {str(k): _env_value(v) for k, v in (runtime_env.get("env_vars") or {}).items()}
        runtime_env["env_vars"] = {**env, **user_env}
        try:
            ray.init(**init_kwargs)
        except Exception as e:  # noqa: BLE001 - Ray raises many types; re-raise with the cause named
            raise RuntimeError(f"Ray failed to start with ray_kwargs.ray_init={init_kwargs}: {e}. "
                               "Set trainer.launcher=local to run a single device without Ray.") from e


def _env_value(value) -> str:
    """An environment variable's text as the user wrote it (``true`` stays lower-case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def run_ppo(cfg: DictConfig, launch=None, make_trainer=None, prompts_per_step: int | None = None) -> dict:
    """Build data, reward and workers, then train. ``launch(cfg, use_critic) -> worker groups``,
    ``make_trainer(*trainer args, **kwargs)`` and ``prompts_per_step`` (for the LR schedule's step count) default
    to the colocated synchronous run; the asynchronous entry points (verl.experimental.async_policy.launch) pass
    their own."""
    from verl.trainer.config.validate import need_critic
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.dataset.rl_dataset import collate_fn, create_rl_dataset
    from verl.utils.tracking import Tracking, announce_run_dir, new_run_dir
    from verl.utils.tokenizer import controller_tokenizer_and_processor

    from transformers import AutoConfig

    from verl.utils.tokenizer import local_model_path
    from verl.utils.user_errors import GuardedDataset, guard, guard_reward_fn

    tokenizer, processor = controller_tokenizer_and_processor(cfg)  # data.trust_remote_code
    # The dataset needs the model config for Qwen3.5-VL mRoPE position ids.
    hf_config = AutoConfig.from_pretrained(local_model_path(cfg.actor_rollout_ref.model),
                                           trust_remote_code=bool(cfg.actor_rollout_ref.model.get("trust_remote_code")))
    with guard("Data", "Check data.train_files / data.val_files and the dataset keys (data.prompt_key, ...)."):
        train_ds = GuardedDataset(create_rl_dataset(cfg.data.train_files, cfg.data, tokenizer, processor,
                                                    is_train=True, model_config=hf_config), "data.train_files")
        val_ds = GuardedDataset(create_rl_dataset(cfg.data.val_files, cfg.data, tokenizer, processor, is_train=False,
                                                  model_config=hf_config), "data.val_files") if cfg.data.get(
            "val_files") else None
    from verl.trainer.ppo import genrm

    router = None
    with guard("Reward", "Check reward.custom_reward_function and reward.reward_manager."):
        reward_kwargs = cfg.reward.get("reward_kwargs") or {}
        if genrm.is_generative(cfg):  # the custom function queries the judge at the router's address
            router, judge_tokenizer = genrm.start_router(cfg)
            reward_kwargs = {**reward_kwargs, "reward_router_address": router.address,
                             "reward_model_tokenizer": judge_tokenizer}
        reward_fn = guard_reward_fn(load_reward_manager(cfg, tokenizer, num_examine=0, **reward_kwargs),
                                    _reward_where(cfg))
        val_reward_fn = guard_reward_fn(load_reward_manager(cfg, tokenizer, num_examine=1, **reward_kwargs),
                                        _reward_where(cfg))
    use_critic = need_critic(cfg)  # critic.enable when set (upstream), else GAE only
    per_step = prompts_per_step or cfg.data.get("gen_batch_size") or cfg.data.train_batch_size
    steps_per_epoch = len(train_ds) // per_step
    total = cfg.trainer.get("total_training_steps") or steps_per_epoch * cfg.trainer.total_epochs
    _set_total_steps(cfg, int(total))
    from verl.trainer.ppo.rollout_corr import prepare_bypass_config

    prepare_bypass_config(cfg)  # bypass_mode hands the actor its loss before the workers start
    try:
        groups = (launch or (lambda c, critic: launch_workers(c, build_role_specs(c, critic))))(cfg, use_critic)
        for wg in groups.values():
            wg.init_model()
        trainer = (make_trainer or RayPPOTrainer)(cfg, tokenizer, groups, train_ds, val_ds, collate_fn, reward_fn,
                                                  val_reward_fn, processor=processor)
    except BaseException:
        if router is not None:  # its port and threads go with the failed start
            router.close()
        raise
    if router is not None:
        genrm.attach_judge(router, groups[genrm.GENRM_ROLE])
        trainer.genrm_router = router
    run_dir = new_run_dir(cfg.trainer.default_local_dir)
    tracker = Tracking(cfg.trainer.project_name, cfg.trainer.experiment_name, default_backend=list(cfg.trainer.logger),
                       config=OmegaConf.to_container(cfg, resolve=True), run_dir=run_dir)
    announce_run_dir(tracker, "reward_curve.png")
    try:
        result = trainer.fit(tracker)
    finally:
        tracker.finish()
        if router is not None:
            router.close()
    curve = plot_reward_curve(result.get("history", []) if isinstance(result, dict) else [], cfg, run_dir)
    if curve:
        print(f"Reward curve written to {curve}", flush=True)
    return result


def _reward_where(cfg: DictConfig) -> str:
    section = cfg.reward.get("custom_reward_function") or {}
    if section.get("path"):
        return f"reward.custom_reward_function.path={section.get('path')!r}, name={section.get('name')!r}"
    return f"reward manager {cfg.reward.reward_manager.get('name')!r} with the default scorer of the data_source"


def plot_reward_curve(history: list[dict], cfg: DictConfig, run_dir: str) -> str | None:
    """PNG of critic/score/mean per step (and validation score where measured) in this run's directory."""
    from verl.utils.plot import plot_history

    val_keys = sorted({k for h in history for k in h if k.startswith("val-core/") and k.endswith("/mean@1")})
    series = [("critic/score/mean", "critic/score/mean (train)", "o-")]
    series += [(k, "val-core mean@1 (greedy)" if len(val_keys) == 1 else k, "s--") for k in val_keys]
    return plot_history(history, series, os.path.join(run_dir, "reward_curve.png"),
                        f"{cfg.trainer.project_name} / {cfg.trainer.experiment_name}", "score", "training/global_step")


def main(argv: list[str] | None = None) -> int:
    """Parse, compose, validate, then train (or print the config for ``--cfg job``); returns the exit code.

    Errors the user fixes are printed as one paragraph (exit 2 for config, 1 for data / reward / model and for
    the run's faults: a non-finite update with trainer.on_nonfinite=error, a checkpoint that cannot be written or
    read, a worker that died); ``VERL_DEBUG=1`` re-raises them with their traceback. SIGTERM saves the step and
    exits 143 (:data:`verl.trainer.faults.PREEMPTED_EXIT_CODE`).
    """
    from verl.trainer import cli
    from verl.trainer.faults import PREEMPTED_EXIT_CODE, Preempted

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = cli.parse_args(argv)
        if args.help:
            print(cli.help_text(args.config_dir))
            return 0
        if args.demo_fallback:
            print(f"No {cli.MODEL_PATH_KEY} given: running the embedded demo (tiny Qwen3.5, letter-echo task) "
                  "with your overrides.", file=sys.stderr, flush=True)
        if args.cfg:
            cfg = _load(args, resolve=False)  # a dry run builds nothing (the demo's assets included)
            cli.print_config(cfg, args)
            return 0
        run_ppo(_load(args, check_host=True))
    except Preempted as exc:  # SIGTERM: the step finished and was saved (verl/trainer/faults.py)
        print(str(exc), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except Exception as exc:  # noqa: BLE001 - user errors become one paragraph, bugs keep their traceback
        code = cli.report_user_error(exc)
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
