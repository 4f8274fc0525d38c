"""Builds what the FSDP engine trains: the HF model (patched, LoRA'd, value head, FSDP2-sharded), optimizer
and LR scheduler, from upstream's config sections (``model``, ``fsdp_config``, ``optim``)."""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from verl.utils.device import get_device_name
from verl.workers.engine.external_lib import import_external_lib

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


@dataclass
class BuiltModel:
    module: torch.nn.Module
    spec: Any = None
    use_remove_padding: bool = False
    use_fused_kernels: bool = False
    is_lora: bool = False
    info: dict = field(default_factory=dict)


def torch_dtype(name: Any, default: torch.dtype, key: str = "dtype") -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    if str(name) not in DTYPES:
        raise ValueError(f"{key}={name!r} is not a dtype; use one of {sorted(DTYPES)}")
    return DTYPES[str(name)]


def apply_liger(model: torch.nn.Module) -> None:
    """``model.use_liger``: Liger's fused kernels patched into this model instance."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise ImportError(
            "actor_rollout_ref.model.use_liger=true needs the liger-kernel package (`pip install liger-kernel`), "
            f"which is not importable here ({exc}); install it or set model.use_liger=false"
        ) from exc
    _apply_liger_kernel_to_instance(model=model)
    logger.info("applied Liger kernels to %s", type(model).__name__)


def uses_cpu_offload_policy(fsdp_cfg) -> bool:
    """Whether FSDP2's CPUOffloadPolicy holds the parameters in host memory: ``param_offload`` here, or
    upstream's ``offload_policy`` (the same policy under its FSDP2 name). The optimizer then steps on the host
    too, so ``optimizer_offload`` has nothing left to move."""
    def setting(key):
        if fsdp_cfg is None:
            return None
        return fsdp_cfg.get(key) if hasattr(fsdp_cfg, "get") else getattr(fsdp_cfg, key, None)

    return bool(setting("param_offload")) or bool(setting("offload_policy"))


def _mixed_precision_dtype(fsdp_cfg, name: str, default: Optional[torch.dtype]) -> Optional[torch.dtype]:
    section = (fsdp_cfg.get("mixed_precision") if fsdp_cfg is not None else None) or {}
    return torch_dtype(section.get(name), default, f"fsdp_config.mixed_precision.{name}")


def precision_policy(fsdp_cfg, model_dtype: torch.dtype) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's mixed-precision policy (upstream's ``fsdp_config.mixed_precision``): parameters are gathered and
    computed in ``param_dtype`` (null: ``fsdp_config.dtype``, bf16 by default) and gradients reduced in
    ``reduce_dtype`` (null: fp32, as upstream), over master weights in ``model_dtype``. None when both equal
    ``model_dtype`` (nothing to cast)."""
    param = _mixed_precision_dtype(fsdp_cfg, "param_dtype", None)
    if param is None:
        param = torch_dtype(fsdp_cfg.get("dtype"), torch.bfloat16, "fsdp_config.dtype")
    reduce = _mixed_precision_dtype(fsdp_cfg, "reduce_dtype", torch.float32)
    if param == model_dtype and reduce == model_dtype:
        return None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, cast_forward_inputs=True)


def cast_buffers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``fsdp_config.mixed_precision.buffer_dtype``: floating-point buffers (e.g. RoPE's inverse frequencies) held
    in ``dtype``, which is what FSDP1's MixedPrecision does with it. FSDP2's policy has no buffer dtype (upstream's
    FSDP2 path drops the key), so the buffers are cast once here, before sharding; null leaves them as loaded."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(module, name, buf.to(dtype))


def build_module(model_cfg, fsdp_cfg, role: str, ulysses_sp_size: int = 1, enable_gc: bool = False,
                 use_fused_kernels: Optional[bool] = None) -> BuiltModel:
    """Load the HF model for ``role`` (actor/ref/critic/sft) through its model spec, patch it, add LoRA or
    the value head, and shard it with FSDP2."""
    from verl.models.registry import get_model_spec, load_hf_model
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.fsdp_utils import apply_fsdp2, create_device_mesh
    from verl.utils.tokenizer import local_model_path
    from verl.workers.engine.role import engine_role

    role_spec = engine_role(role)
    fsdp_cfg = fsdp_cfg if fsdp_cfg is not None else {}
    import_external_lib(model_cfg)
    path = local_model_path(model_cfg)
    device = get_device_name()
    on_cpu = device == "cpu"
    # Master weights in fsdp_config.model_dtype (fp32 by default, as upstream); bf16 compute on accelerators
    # through the mixed-precision policy below. override_config entries are set on the HF config.
    dtype = torch_dtype(fsdp_cfg.get("model_dtype"), torch.float32, "fsdp_config.model_dtype")
    if role_spec.head == "score":
        from verl.workers.reward_model.score_model import load_score_model

        model = load_score_model(path, dtype, trust_remote_code=bool(model_cfg.get("trust_remote_code", False)),
                                 where=role_spec.model_section)
    else:
        model = load_hf_model(path, dtype=dtype, trust_remote_code=bool(model_cfg.get("trust_remote_code", False)),
                              declared_model_type=model_cfg.get("model_type"),
                              config_overrides=model_cfg.get("override_config"))
    from verl.models.moe_router import configure_moe_router

    configure_moe_router(model, model_cfg, role)  # MoE: router aux loss off in RL unless enable_router_aux_loss
    spec = get_model_spec(model.config)
    mtp = mtp_settings(model_cfg, role)
    if mtp["enable"]:
        # Before patching and sharding: the MTP decoder layers take the patched forward and their own FSDP unit.
        support = spec.resolve("mtp")
        if support is None:
            raise ValueError(f"{engine_role(role).model_section}.mtp.enable=true: {spec.architecture} has no "
                             "multi-token-prediction support here (Qwen3.5 checkpoints only)")
        support.attach(model, path, key=f"{engine_role(role).model_section}.mtp.enable")
        if ulysses_sp_size > 1:
            raise ValueError(f"{engine_role(role).model_section}.mtp.enable=true with "
                             f"ulysses_sequence_parallel_size={ulysses_sp_size}: the MTP loss needs whole packed "
                             "rows (not implemented with Ulysses sequence parallelism here)")
        # Hooks on the HF model's own submodules: they stay valid under LoRA's wrapper and FSDP2's in-place wrap.
        mtp["runner"] = support.runner(model, detach_encoder=mtp["detach_encoder"])
    if bool(model_cfg.get("use_liger", False)):
        apply_liger(model)
    if role_spec.head == "value":
        from verl.workers.critic.value_model import ValueModel

        model = ValueModel(model).to(dtype)
    use_rmpad = bool(model_cfg.get("use_remove_padding", True)) and spec.packs_with(model.config)
    if use_fused_kernels is None:
        use_fused_kernels = bool(model_cfg.get("use_fused_kernels", False))
    use_fused = use_fused_kernels and not role_spec.value_head  # fused kernels compute LM-head log-probs
    fused_backend = (model_cfg.get("fused_kernel_options") or {}).get("impl_backend", "torch") if use_fused else None
    from verl.models.kernels import report_kernels

    report_kernels(spec, use_rmpad, on_cuda=not on_cpu and device == "cuda",
                   rank0=not dist.is_initialized() or dist.get_rank() == 0)
    if ulysses_sp_size > 1 and not use_rmpad:
        raise ValueError(f"ulysses_sequence_parallel_size={ulysses_sp_size} needs packed sequences "
                         f"(model.use_remove_padding=true on a model whose spec supports packing; "
                         f"{spec.architecture} packs: {spec.packs_with(model.config)})")
    apply_monkey_patch(model, ulysses_sp_size=ulysses_sp_size, use_remove_padding=use_rmpad,
                       use_fused_kernels=use_fused, fused_kernels_backend=fused_backend)
    if enable_gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from verl.workers.lora import apply_lora, lora_enabled

    is_lora = role_spec.lora and lora_enabled(model_cfg)
    if is_lora:
        model = apply_lora(model, model_cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = create_device_mesh(world, int(fsdp_cfg.get("fsdp_size", -1) or -1), "cpu" if on_cpu else device)
    mp = None
    buffer_dtype = _mixed_precision_dtype(fsdp_cfg, "buffer_dtype", None)
    if buffer_dtype is not None:
        cast_buffers(model, buffer_dtype)
    if not on_cpu:  # the CPU build computes in the weights' dtype (no autocast, no cast policy)
        mp = precision_policy(fsdp_cfg, dtype)
        model = model.to(device)
    apply_fsdp2(model, mesh, mp, param_offload=uses_cpu_offload_policy(fsdp_cfg) and not on_cpu,
                reshard_after_forward=bool(fsdp_cfg.get("reshard_after_forward", True)),
                wrap_policy=fsdp_cfg.get("wrap_policy"))
    if not role_spec.trainable:
        model.requires_grad_(False)
    return BuiltModel(model, spec=spec, use_remove_padding=use_rmpad, use_fused_kernels=use_fused, is_lora=is_lora,
                      info={"path": path, "model_type": getattr(model.config, "model_type", None), "mtp": mtp})


def mtp_settings(model_cfg, role: str) -> dict:
    """Upstream's ``model.mtp`` section as this role uses it: ``enable`` loads (and saves) the checkpoint's MTP
    head, ``enable_train`` adds its loss, ``enable_rollout`` drafts with it in the hf rollout engine. The trainable
    policy (actor, SFT) carries the head, and so does a rollout pool's own policy copy when it drafts with it;
    upstream forces the reference model's MTP off, and a value model has no LM head to share."""
    from verl.utils.config import cfg_get
    from verl.workers.engine.role import engine_role

    section = cfg_get(model_cfg, "mtp", None) or {}
    spec = engine_role(role)
    rollout = bool(cfg_get(section, "enable", False)) and bool(cfg_get(section, "enable_rollout", False))
    enable = bool(cfg_get(section, "enable", False)) and not spec.value_head and (
        spec.trainable or (role == "rollout" and rollout))
    return {"enable": enable, "train": enable and spec.trainable and bool(cfg_get(section, "enable_train", False)),
            "rollout": enable and rollout,
            "detach_encoder": bool(cfg_get(section, "detach_encoder", False)),
            "scale": float(cfg_get(section, "mtp_loss_scaling_factor", 0.1))}


# ------------------------------------------------------------------------------------------ optimizer
def build_optimizer(module: torch.nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """``optim.optimizer`` from ``optim.optimizer_impl`` (AdamW from torch.optim by default) over the trainable
    parameters, with the config's lr / weight decay / betas / eps where the class takes them, plus
    ``override_optimizer_config``."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (check lora/target_modules settings)")
    impl = str(optim_cfg.get("optimizer_impl") or "torch.optim")
    name = str(optim_cfg.get("optimizer") or "AdamW")
    try:
        cls = getattr(importlib.import_module(impl), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"optim.optimizer={name!r} was not found in optim.optimizer_impl={impl!r} ({exc})") from exc
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {"lr": optim_cfg.lr, "weight_decay": optim_cfg.get("weight_decay", 0.01)}
    if "betas" in accepted:
        kwargs["betas"] = tuple(optim_cfg.get("betas", (0.9, 0.999)))
    if "eps" in accepted:
        kwargs["eps"] = optim_cfg.get("eps", 1e-8)
    if "foreach" in accepted and all(p.device.type == "cpu" for p in params):
        # torch picks the per-parameter loop on CPU; on a small model that loop of ~10 ops per tensor costs
        # more than the arithmetic (65 ms of each demo step), the multi-tensor form does the same math.
        kwargs["foreach"] = True
    override = optim_cfg.get("override_optimizer_config") or {}
    kwargs.update(dict(override))
    return cls(params, **kwargs)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_cfg):
    """Linear warm-up, then constant or cosine decay (``optim.lr_scheduler_type``, alias ``warmup_style``)."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    total = int(optim_cfg.get("total_training_steps", 0) or 0)
    warmup = int(optim_cfg.get("lr_warmup_steps", -1) if optim_cfg.get("lr_warmup_steps") is not None else -1)
    if warmup < 0:
        warmup = int(float(optim_cfg.get("lr_warmup_steps_ratio", 0.0)) * max(total, 0))
    style = optim_cfg.get("lr_scheduler_type") or optim_cfg.get("warmup_style") or "constant"
    if style == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if style == "cosine":
        if total <= 0:
            raise ValueError("optim.lr_scheduler_type=cosine needs the total number of training steps")
        return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total,
                                               min_lr_ratio=float(optim_cfg.get("min_lr_ratio") or 0.0),
                                               num_cycles=float(optim_cfg.get("num_cycles", 0.5)),
                                               zero_indexed_step=bool(optim_cfg.get("zero_indexed_step", True)))
    raise ValueError(f"optim.lr_scheduler_type={style!r} is not supported; use constant or cosine")
