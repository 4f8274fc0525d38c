"""Building the pieces of the Megatron engine: parallel state, model chunks, DDP, optimizer and scheduler.

Everything here imports megatron-core; the engine calls it after :func:`require_mcore`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from verl.single_controller.worker import Worker

from .layout import RANK_ORDER
from .settings import MegatronSettings

logger = logging.getLogger(__name__)

__all__ = ["BuildTimer", "build_ddp", "build_model_chunks", "build_optimizer", "build_scheduler",
           "init_parallel_state", "optim_value"]


class BuildTimer:
    """Seconds per phase of building something, printed by global rank 0 as one line: where a large model's
    start-up goes (on 4 x H200, 2026-11-27, the Qwen3.5-35B-A3B shape's Megatron launch spent 285 s before its
    first step, its dense twin 77 s)."""

    def __init__(self, what: str):
        import time

        self.what, self._clock, self.phases = what, time.perf_counter, []
        self._t = self._clock()

    def lap(self, phase: str) -> None:
        now = self._clock()
        self.phases.append((phase, now - self._t))
        self._t = now

    def report(self) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            total = sum(s for _, s in self.phases)
            parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases)
            print(f"[verl.megatron] {self.what} in {total:.1f} s ({parts})", flush=True)


def init_parallel_state(s: MegatronSettings) -> None:
    """megatron-core's parallel groups over the worker's process group (once per process: the actor and
    a colocated reference share them, so a second engine must ask for the same layout)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    # The worker normally owns the process group; a lone process (benchmarks, SFT scripts) gets a group of one.
    Worker.ensure_process_group()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
    torch.cuda.set_device(local_rank)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        want = (s.tp, s.pp, s.cp, s.ep)
        if have != want:
            raise ValueError(f"megatron parallel state already initialised with (tp, pp, cp, ep)={have}; this "
                             f"engine asks for {want}: colocated roles must use the same Megatron layout")
    else:
        world = dist.get_world_size()
        if world % s.model_parallel_size:
            raise ValueError(f"tensor * pipeline * context parallel size ({s.model_parallel_size}) must divide the "
                             f"world size ({world}); change actor_rollout_ref.actor.megatron.*_parallel_size")
        # Pipeline outermost (megatron-core's default order): the dense and expert pipeline groups then coincide
        # for any expert * expert-tensor parallel size. A data-parallel replica is therefore not a block of
        # consecutive ranks; the controller dispatches by layout.megatron_dp_layout, the same decomposition.
        ps.initialize_model_parallel(
            order=RANK_ORDER,
            tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
            virtual_pipeline_model_parallel_size=s.vpp if (s.vpp or 1) > 1 else None,
            context_parallel_size=s.cp, expert_model_parallel_size=s.ep, expert_tensor_parallel_size=s.etp)
    tensor_parallel.model_parallel_cuda_manual_seed(s.seed)


def build_model_chunks(tfconfig, hf_config, init_fn: Callable, s: MegatronSettings, tie_embeddings: Optional[bool],
                       value: bool = False) -> list[torch.nn.Module]:
    """One model chunk per virtual pipeline stage of this rank, on the GPU, in the training dtype."""
    from megatron.core import parallel_state as ps

    chunks = []
    vpp = s.vpp if (s.vpp or 1) > 1 else None
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = init_fn(tfconfig, hf_config, pre_process=pre, post_process=post,
                        share_embeddings_and_output_weights=tie_embeddings, value=value, vp_stage=stage)
        # Built directly in the training dtype (params_dtype): no Float16Module, whose fp32 cast of the last
        # stage's output would also hit the final hidden states the log-prob path reads. The distributed
        # optimizer keeps fp32 master weights.
        model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def build_ddp(chunks: list, tfconfig, s: MegatronSettings) -> list:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # Unknown override_ddp_config fields were refused by name in read_settings (config_fields).
    kw = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
              use_distributed_optimizer=s.use_distributed_optimizer)
    kw.update(s.override_ddp_config)
    ddp_config = DistributedDataParallelConfig(**kw)
    # Only the first chunk gets bucketing (overlap of the others' reduction is of no use without overlap).
    return [DistributedDataParallel(config=tfconfig, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(chunks)]


def optim_value(optim_cfg: Any, key: str, default: Any = None) -> Any:
    if optim_cfg is None:
        return default
    value = optim_cfg.get(key, default) if hasattr(optim_cfg, "get") else getattr(optim_cfg, key, default)
    return default if value is None else value


_OPTIMIZERS = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}


def build_optimizer(chunks: list, optim_cfg: Any, tfconfig, s: MegatronSettings):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    name = str(optim_value(optim_cfg, "optimizer", "adam")).lower()
    if name not in _OPTIMIZERS:
        raise ValueError(f"optim.optimizer={name!r} is not supported by the Megatron engine; use adam or sgd")
    betas = list(optim_value(optim_cfg, "betas", [0.9, 0.999]))
    kw = dict(
        optimizer=_OPTIMIZERS[name], lr=float(optim_value(optim_cfg, "lr", 1e-6)),
        min_lr=float(optim_value(optim_cfg, "min_lr", 0.0)),
        weight_decay=float(optim_value(optim_cfg, "weight_decay", 0.01)),
        adam_beta1=float(betas[0]), adam_beta2=float(betas[1]),
        clip_grad=float(optim_value(optim_cfg, "clip_grad", 1.0)),
        bf16=bool(tfconfig.bf16), fp16=False, params_dtype=tfconfig.params_dtype,
        use_distributed_optimizer=s.use_distributed_optimizer,
    )
    overrides = dict(optim_value(optim_cfg, "override_optimizer_config", {}) or {})
    unknown = sorted(set(overrides) - set(OptimizerConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"optim.override_optimizer_config has keys {unknown} that megatron-core's "
                         "OptimizerConfig does not know")
    kw.update(overrides)
    return get_megatron_optimizer(OptimizerConfig(**kw), chunks)


def build_scheduler(optimizer, optim_cfg: Any):
    """megatron-core's OptimizerParamScheduler from the ``optim`` section (upstream's keys)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total = max(int(optim_value(optim_cfg, "total_training_steps", -1)), 1)
    warmup = int(optim_value(optim_cfg, "lr_warmup_steps", -1))
    if warmup < 0:
        warmup = int(float(optim_value(optim_cfg, "lr_warmup_steps_ratio", 0.0)) * total)
    decay = optim_value(optim_cfg, "lr_decay_steps", None)
    decay = int(decay) if decay is not None else total
    decay = max(decay, warmup + 1)
    lr = float(optim_value(optim_cfg, "lr", 1e-6))
    wd = float(optim_value(optim_cfg, "weight_decay", 0.01))
    wsd = optim_value(optim_cfg, "lr_wsd_decay_steps", None)
    return OptimizerParamScheduler(
        optimizer, init_lr=float(optim_value(optim_cfg, "lr_warmup_init", 0.0)) if warmup > 0 else lr,
        max_lr=lr, min_lr=float(optim_value(optim_cfg, "min_lr", 0.0)), lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=str(optim_value(optim_cfg, "lr_decay_style", "constant")),
        start_wd=wd, end_wd=wd, wd_incr_steps=total,
        wd_incr_style=str(optim_value(optim_cfg, "weight_decay_incr_style", "constant")),
        use_checkpoint_opt_param_scheduler=bool(optim_value(optim_cfg, "use_checkpoint_opt_param_scheduler", False)),
        override_opt_param_scheduler=not bool(optim_value(optim_cfg, "use_checkpoint_opt_param_scheduler", False)),
        wsd_decay_steps=int(wsd) if wsd is not None else None,
        lr_wsd_decay_style=str(optim_value(optim_cfg, "lr_wsd_decay_style", "exponential")),
    )


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()

