"""Entry point: ``python -m verl.trainer.sft_trainer [--config-name NAME] [key=value ...]`` (or ``torchrun
--nproc_per_node=N -m verl.trainer.sft_trainer ...``): supervised fine-tuning on multi-turn conversations.

The config is ``sft_trainer_engine.yaml`` (upstream verl's keys), composed with Hydra's override grammar and
checked like ``main_ppo``'s: an unknown key names the nearest valid one. ``engine=megatron`` picks the
Megatron engine (and its optimizer group unless ``optim=`` is given); the trainer itself talks to the
training-engine interface only. When neither ``model.path`` nor ``data.train_files`` is given (e.g. no
arguments at all), the embedded demo runs (``sft_demo.yaml``) with any other overrides on top.
``--help`` shows the usage and the config groups, ``--cfg job`` the composed config; neither trains.
"""

from __future__ import annotations

import warnings

import logging
import os
import sys
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from verl.trainer.sft.dataset import create_sft_dataset  # noqa: F401 (upstream name)
from verl.trainer.sft.trainer import SFTTrainer

logger = logging.getLogger(__name__)

__all__ = ["SFTTrainer", "compose_sft_config", "create_sft_dataset", "load_config", "main", "run_sft", "validate_sft_config"]

_ENGINE_GROUP = "engine"
_DEMO_TRIGGERS = ("model.path", "data.train_files")


def _override_key(text: str) -> str:
    return text.lstrip("~+").split("=", 1)[0]


def _config_name_given(argv: list[str]) -> bool:
    return any(a.split("=", 1)[0] in ("--config-name", "-cn") for a in argv)


def load_config(argv: list[str]) -> tuple[DictConfig, str]:
    """Compose and check the config; returns it with the engine strategy (a training-engine registry key)."""
    cfg, strategy = compose_sft_config(argv)
    validate_sft_config(cfg, strategy)
    return cfg, strategy


def compose_sft_config(argv: list[str], resolve: bool = True) -> tuple[DictConfig, str]:
    """Compose the config from command-line arguments (every override key checked), resolved unless
    ``resolve`` is false, not validated."""
    from verl.trainer.config.checks import compose_config, split_overrides
    from verl.trainer.demo.sft_task import register_resolver
    from verl.trainer.cli import parse_args

    register_resolver()
    args = parse_args(argv)  # --config-path/--config-name exactly as main_ppo reads them
    name, path, overrides = args.config_name, args.config_dir, args.overrides
    if not _config_name_given(argv):
        touched = {_override_key(o) for o in overrides}
        name = "sft_trainer_engine" if touched & set(_DEMO_TRIGGERS) else "sft_demo"
    groups, _ = split_overrides(overrides, path)
    choices = {g.split("=", 1)[0]: g.split("=", 1)[1] for g in groups if "=" in g}
    engine_choice = choices.get(_ENGINE_GROUP)
    if engine_choice and "optim" not in choices:
        overrides = [*overrides, f"optim={engine_choice}"]  # the optimizer section follows the engine
    cfg = compose_config(name, overrides, config_dir=path, validate=False)
    if resolve:
        OmegaConf.resolve(cfg)
    return cfg, str(cfg.engine.get("strategy") or engine_choice or "fsdp")


def validate_sft_config(cfg: DictConfig, strategy: str) -> None:
    """Problems of an SFT config, all at once, each naming its key (raises ConfigValidationError)."""
    from verl.trainer.config.checks import ConfigValidationError
    from verl.utils.dataset.multiturn_sft_dataset import PAD_MODES, TRUNCATION_MODES
    from verl.workers.engine import EngineRegistry

    from verl.trainer.config.key_status import check_key_status

    # Upstream keys not implemented here must keep their defaults. The SFT config's data.* keys are its own
    # (the same names mean other things in the PPO config, where key_status.txt classifies them).
    problems, notes = (
        [m for m in found if not m.lstrip("`").startswith("data.")] for found in check_key_status(cfg))
    for note in notes:
        warnings.warn(note, stacklevel=2)
    EngineRegistry.check(strategy, problems)
    d, t = cfg.data, cfg.trainer
    for key in ("train_batch_size", "micro_batch_size_per_gpu", "max_token_len_per_gpu", "max_length"):
        if not isinstance(d.get(key), int) or isinstance(d.get(key), bool) or d.get(key) <= 0:
            problems.append(f"`data.{key}` must be a positive integer, got {d.get(key)!r}")
    if d.pad_mode not in PAD_MODES:
        problems.append(f"`data.pad_mode={d.pad_mode!r}` is not supported; use one of {list(PAD_MODES)}")
    elif d.pad_mode == "no_padding":
        # Megatron's switch is engine.use_remove_padding (model.use_remove_padding is its deprecated alias).
        key = "engine.use_remove_padding" if "use_remove_padding" in cfg.engine else "model.use_remove_padding"
        if not OmegaConf.select(cfg, key):
            problems.append(f"`data.pad_mode=no_padding` trains on packed sequences, which needs `{key}=true` "
                            "(or set `data.pad_mode=right`)")
    if d.truncation not in TRUNCATION_MODES:
        problems.append(f"`data.truncation={d.truncation!r}` is not supported; use one of {list(TRUNCATION_MODES)}")
    if not d.get("train_files"):
        problems.append("`data.train_files` is empty")
    from verl.trainer.config.lora_section import lora_section_conflicts

    for section_key, flat_key in lora_section_conflicts(cfg):
        problems.append(f"`{section_key}` and `{flat_key}` are one setting (upstream's new and old spelling) and "
                        "are set to different values; set one of them")
    from verl.workers.lora_init import LORA_A_INITS, LORA_B_INITS

    for key, allowed in (("lora_A_init_method", LORA_A_INITS), ("lora_B_init_method", LORA_B_INITS)):
        value = (cfg.model.get("lora") or {}).get(key)
        if value is not None and value not in allowed:
            problems.append(f"`model.lora.{key}={value!r}` is not an init method here; use one of {sorted(allowed)} "
                            "or null")
    lora_rank, adapter = cfg.model.get("lora_rank") or 0, cfg.model.get("lora_adapter_path")
    if strategy == "megatron" and (lora_rank > 0 or adapter):
        # The Megatron engine has no LoRA; its own error would name the RL keys (actor_rollout_ref.model.*).
        key = f"model.lora_rank={lora_rank}" if lora_rank > 0 else f"model.lora_adapter_path={adapter}"
        problems.append(f"`{key}` with `engine=megatron`: LoRA SFT runs on the FSDP engine only; use "
                        "`engine=fsdp` for LoRA, or `model.lora_rank=0` (and no `model.lora_adapter_path`) "
                        "for full fine-tuning on Megatron")
    from verl.trainer.config.mtp_section import mtp_problems

    problems.extend(mtp_problems(lambda key: OmegaConf.select(cfg, key), "model", strategy))
    if strategy == "megatron" and cfg.model.get("enable_router_aux_loss"):
        problems.append("`model.enable_router_aux_loss=true` with `engine=megatron`: the MoE load-balancing loss "
                        "is built on the FSDP engine only (Megatron's router trains without it); use `engine=fsdp`")
    if t.resume_mode not in ("auto", "disable", "resume_path"):
        problems.append(f"`trainer.resume_mode={t.resume_mode!r}`; use auto, disable or resume_path")
    if t.get("on_nonfinite", "skip") not in ("skip", "error"):
        problems.append(f"`trainer.on_nonfinite={t.get('on_nonfinite')!r}`; use skip or error")
    for key in ("save_freq", "test_freq"):
        value = t.get(key)
        if value != "after_each_epoch" and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"`trainer.{key}={value!r}`; use a number of steps, -1 or after_each_epoch")
    steps = t.get("total_training_steps")
    if steps is not None and (not isinstance(steps, int) or steps <= 0):
        problems.append(f"`trainer.total_training_steps={steps!r}` must be a positive integer or null")
    device = _device_problem(t.device)
    if device:
        problems.append(device)
    if problems:
        raise ConfigValidationError(problems)


def _device_problem(device) -> Optional[str]:
    from verl.utils.device import get_device_name

    if device not in ("cuda", "npu", "cpu"):
        return f"`trainer.device={device!r}`; use cuda, npu or cpu"
    if device != get_device_name():
        return (f"`trainer.device={device}` but this host runs on {get_device_name()}; set "
                f"`trainer.device={get_device_name()}`")
    return None


def _default_device_to_host(cfg: DictConfig, argv: list[str]) -> None:
    """``trainer.device`` not named on the command line (upstream's default is ``cuda``) follows the host, said
    in one line; a device the user names is kept, and a wrong one is reported with the paths, before the
    batch-size checks."""
    from verl.utils.device import get_device_name

    host = get_device_name()
    named = any(_override_key(a) == "trainer.device" for a in argv)
    if not named and cfg.trainer.device != host:
        if os.environ.get("RANK", "0") == "0":  # one line, not one per torchrun rank
            print(f"trainer.device={cfg.trainer.device} (from the config) but this host has no {cfg.trainer.device}: "
                  f"training on {host}; name trainer.device on the command line to choose", file=sys.stderr,
                  flush=True)
        cfg.trainer.device = host


def _load_for_run(argv: list[str]) -> tuple[DictConfig, str]:
    """:func:`load_config` for a real run: the device follows the host unless named, and the model directory,
    data files and device are checked first, each missing one listed before the config's other problems."""
    from verl.trainer.preflight import host_problems, validate_in_order

    cfg, strategy = compose_sft_config(argv)
    _default_device_to_host(cfg, argv)
    first = host_problems(cfg, ("model.path", "model.tokenizer_path"), ("data.train_files", "data.val_files"))
    device = _device_problem(cfg.trainer.device)
    validate_in_order(cfg, first + ([device] if device else []), lambda c: validate_sft_config(c, strategy))
    return cfg, strategy


def _init_distributed() -> None:
    """Join (or, for a single process, create) the default process group: gloo on CPU, nccl on GPUs."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # plain `python -m`: a group of one
        from verl.utils.net import find_free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    from verl.single_controller.worker import Worker

    Worker.ensure_process_group()


def _seed(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_sft(config: DictConfig, strategy: str = "fsdp") -> dict:
    """Train; returns the trainer's result (``history`` of logged metrics, last ``checkpoint``, ``loss_curve``,
    ``run_dir``: this run's own folder under ``trainer.default_local_dir/runs/`` with the curve and metric log)."""
    import torch.distributed as dist

    from verl.utils.plot import plot_history
    from verl.utils.tracking import Tracking, announce_run_dir, new_run_dir

    _init_distributed()
    _seed(int(config.trainer.seed))
    rank = dist.get_rank()
    planned = int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)
    if planned != dist.get_world_size() and rank == 0:
        # torchrun decides the process count; these keys only describe it (the batch split follows the real one).
        logger.warning("trainer.nnodes * trainer.n_gpus_per_node = %d but %d processes were launched; training "
                       "on %d", planned, dist.get_world_size(), dist.get_world_size())
    trainer = SFTTrainer(config, strategy)
    tracker = run_dir = None
    if rank == 0:
        run_dir = new_run_dir(config.trainer.default_local_dir)
        tracker = Tracking(config.trainer.project_name, config.trainer.experiment_name,
                           default_backend=list(config.trainer.logger), config=OmegaConf.to_container(config),
                           run_dir=run_dir)
        announce_run_dir(tracker, "loss_curve.png")
    try:
        result = trainer.fit(tracker)
    finally:
        if tracker is not None:
            tracker.finish()
    result["loss_curve"], result["run_dir"] = None, run_dir
    if rank == 0:
        out = os.path.join(run_dir, "loss_curve.png")
        result["loss_curve"] = plot_history(result["history"], [("train/loss", "train/loss", "o-"),
                                                                ("val/loss", "val/loss", "s--")],
                                            out, f"{config.trainer.project_name} / {config.trainer.experiment_name}",
                                            "loss", "training/global_step")
        if result["loss_curve"]:
            print(f"Loss curve written to {result['loss_curve']}", flush=True)
    return result


_ABOUT = (
    "Supervised fine-tuning on multi-turn conversations with upstream verl's sft_trainer_engine keys. With",
    "neither model.path nor data.train_files (and no --config-name) the embedded demo runs: a tiny Qwen3.5",
    "learning calculator tool calls on this host's device, with your overrides applied. docs/sft.md",
)


def _print_config(argv: list[str], args) -> None:
    """``--cfg job``: compose and validate, print, run nothing. The demo's assets are not built: their paths
    show as a placeholder (or as the ``${verl_sft_demo:...}`` interpolation without ``--resolve``)."""
    from verl.trainer import cli
    from verl.trainer.demo.sft_task import dry_run

    with dry_run():
        cfg, strategy = compose_sft_config(argv, resolve=False)
        resolved = cfg.copy()
        OmegaConf.resolve(resolved)
        _default_device_to_host(resolved, argv)
        validate_sft_config(resolved, strategy)
        if args.resolve:
            cfg = resolved
        cli.print_config(cfg, args)


def main(argv: Optional[list[str]] = None) -> int:
    """Compose, validate, train; returns the exit code.

    Errors the user fixes (config keys and values, data files and rows, model paths) are printed as one
    paragraph, as ``main_ppo`` prints them (exit 2 for config, 1 for the rest); ``VERL_DEBUG=1`` re-raises
    them with their traceback. Anything else is a bug and keeps its traceback."""
    from verl.trainer import cli
    from verl.trainer.faults import PREEMPTED_EXIT_CODE, Preempted

    argv = sys.argv[1:] if argv is None else argv
    import torch.distributed as dist

    try:
        args = cli.parse_args(argv)
        if args.help:
            print(cli.help_text(args.config_dir, module="verl.trainer.sft_trainer", about=_ABOUT))
            return 0
        if args.cfg:
            _print_config(argv, args)
            return 0
        cfg, strategy = _load_for_run(argv)
        run_sft(cfg, strategy)
        if dist.is_initialized():
            # Every rank leaves together: a rank that tears its gloo group down while another is still in a
            # collective makes that one abort at exit ("terminate called without an active exception").
            dist.barrier()
    except Preempted as exc:  # SIGTERM: the step finished and was saved (verl/trainer/faults.py)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(str(exc), file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except Exception as exc:  # noqa: BLE001 - user errors become one paragraph, bugs keep their traceback
        code = cli.report_user_error(exc)
        if code is None:
            raise
        return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
