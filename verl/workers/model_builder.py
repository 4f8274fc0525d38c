"""Builds what a worker trains: tokenizer/processor, the HF model (patched, LoRA'd, FSDP2-sharded), optimizer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from verl.utils.device import get_device_name

logger = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    module: torch.nn.Module
    use_remove_padding: bool = False
    use_fused_kernels: bool = False
    is_lora: bool = False
    info: dict = field(default_factory=dict)


def local_model_path(model_cfg) -> str:
    path = os.path.expanduser(str(model_cfg.path))
    if model_cfg.get("use_shm", False):
        from verl.utils.fs import copy_to_shm

        path = copy_to_shm(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_cfg.path!r} is not a directory. Point it at a local Hugging Face "
            "checkpoint (config.json + weights); no model hub is contacted."
        )
    return path


def load_tokenizer_and_processor(model_cfg):
    """Tokenizer (must have a chat template) and, for VL checkpoints, the processor."""
    from transformers import AutoTokenizer

    from verl.utils.processor import load_processor

    path = local_model_path(model_cfg)
    tok_path = os.path.expanduser(str(model_cfg.get("tokenizer_path") or path))
    trust = bool(model_cfg.get("trust_remote_code", False))
    tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=trust)
    custom = model_cfg.get("custom_chat_template")
    if custom:
        tokenizer.chat_template = custom
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer at {tok_path} has no chat template; set actor_rollout_ref.model.custom_chat_template "
            "or use a checkpoint whose tokenizer_config.json defines one"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    processor = None
    try:
        # Like AutoProcessor, but image-only where the video processor needs the missing torchvision.
        processor = load_processor(tok_path, trust_remote_code=trust)
        if processor is tokenizer or not hasattr(processor, "image_processor"):
            processor = None
    except (OSError, ValueError, TypeError, KeyError):
        processor = None  # text-only checkpoints have no processor config
    if processor is not None and custom:
        processor.chat_template = custom
    return tokenizer, processor


def _torch_dtype(name, default):
    if name is None:
        return default
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
            "fp32": torch.float32, "float32": torch.float32}[str(name)]


def shard_model(model_cfg, fsdp_cfg, role: str, ulysses_sp_size: int = 1, enable_gc: bool = False) -> BuiltModel:
    """Load the HF model for ``role`` (actor/ref/critic), apply Qwen3.5 patches, LoRA, and FSDP2."""
    from verl.models.registry import get_model_spec, load_hf_model
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.fsdp_utils import apply_fsdp2, create_device_mesh

    path = local_model_path(model_cfg)
    device = get_device_name()
    on_cpu = device == "cpu"
    # fp32 master weights everywhere; bf16 compute on accelerators (mixed precision policy below).
    # override_config entries (e.g. attn_implementation) are config kwargs of from_pretrained.
    model = load_hf_model(path, dtype=torch.float32, trust_remote_code=bool(model_cfg.get("trust_remote_code", False)),
                          declared_model_type=model_cfg.get("model_type"),
                          **dict(model_cfg.get("override_config") or {}))
    from verl.models.moe_router import configure_moe_router

    configure_moe_router(model, model_cfg, role)  # MoE: router aux loss off in RL unless enable_router_aux_loss
    if role == "critic":
        from verl.workers.critic.value_model import ValueModel

        model = ValueModel(model)
    spec = get_model_spec(model.config)
    # Packing needs boundary-aware attention: Qwen3.5's patched layers, or flash-attn varlen for other models.
    packable = spec.family.startswith("qwen3_5") or getattr(model.config, "_attn_implementation", "") == "flash_attention_2"
    use_rmpad = bool(model_cfg.get("use_remove_padding", True)) and spec.supports_packing and packable
    use_fused = bool(model_cfg.get("use_fused_kernels", False)) and role != "critic"
    fused_backend = (model_cfg.get("fused_kernel_options") or {}).get("impl_backend", "torch") if use_fused else None
    if role != "critic":
        apply_monkey_patch(model, ulysses_sp_size=ulysses_sp_size, use_remove_padding=use_rmpad,
                           use_fused_kernels=use_fused, fused_kernels_backend=fused_backend)
    if enable_gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    is_lora = role == "actor" and (int(model_cfg.get("lora_rank", 0) or 0) > 0
                                   or bool(model_cfg.get("lora_adapter_path")))  # adapter sets the rank
    if is_lora:
        from verl.workers.lora import apply_lora

        model = apply_lora(model, model_cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = create_device_mesh(world, int(fsdp_cfg.get("fsdp_size", -1) or -1), "cpu" if on_cpu else device)
    mp = None
    if not on_cpu:
        mp = MixedPrecisionPolicy(param_dtype=_torch_dtype((fsdp_cfg.get("mixed_precision") or {}).get("param_dtype"),
                                                           torch.bfloat16),
                                  reduce_dtype=torch.float32, cast_forward_inputs=True)
        model = model.to(device)
    if role == "ref" and not on_cpu:
        mp = None
        model = model.to(torch.bfloat16)
    apply_fsdp2(model, mesh, mp, param_offload=bool(fsdp_cfg.get("param_offload", False)) and not on_cpu,
                reshard_after_forward=bool(fsdp_cfg.get("reshard_after_forward", True)))
    if role == "ref":
        model.requires_grad_(False)
    return BuiltModel(model, use_remove_padding=use_rmpad, use_fused_kernels=use_fused, is_lora=is_lora,
                      info={"path": path, "model_type": getattr(model.config, "model_type", None)})


def build_optimizer_and_scheduler(module: torch.nn.Module, optim_cfg):
    """AdamW over trainable parameters, with linear warm-up then constant or cosine decay."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (check lora/target_modules settings)")
    betas = tuple(optim_cfg.get("betas", (0.9, 0.999)))
    optimizer = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=betas,
                                  weight_decay=optim_cfg.get("weight_decay", 0.01), eps=optim_cfg.get("eps", 1e-8))
    total = int(optim_cfg.get("total_training_steps", 0) or 0)
    warmup = int(optim_cfg.get("lr_warmup_steps", -1) if optim_cfg.get("lr_warmup_steps") is not None else -1)
    if warmup < 0:
        warmup = int(float(optim_cfg.get("lr_warmup_steps_ratio", 0.0)) * max(total, 0))
    style = optim_cfg.get("lr_scheduler_type") or optim_cfg.get("warmup_style") or "constant"
    if style == "constant":
        sched = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    elif style == "cosine":
        if total <= 0:
            raise ValueError("optim.lr_scheduler_type=cosine needs the total number of training steps")
        sched = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total,
                                                min_lr_ratio=float(optim_cfg.get("min_lr_ratio") or 0.0),
                                                num_cycles=float(optim_cfg.get("num_cycles", 0.5)))
    else:
        raise ValueError(f"optim.lr_scheduler_type={style!r} is not supported; use constant or cosine")
    return optimizer, sched

