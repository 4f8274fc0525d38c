"""Sharded FSDP2 checkpoints in upstream verl's layout.

``<dir>/model_world_size_{W}_rank_{r}.pt``, ``optim_world_size_{W}_rank_{r}.pt`` and
``extra_state_world_size_{W}_rank_{r}.pt`` (lr scheduler + RNG) hold each rank's local shards;
``<dir>/huggingface/`` holds the config and tokenizer (and, with ``save_contents`` containing
``hf_model``, full HF weights; for a LoRA actor the adapter merged in). A LoRA actor also gets
``<dir>/lora_adapter/`` (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's format) on every
save. Files are written under a temporary name and renamed, so a crash leaves
no truncated file behind; the trainer marks a step as latest only after every part is on disk.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from verl.utils.checkpoint.step_dirs import atomic_torch_save, torch_load
from verl.utils.fsdp_utils import full_state_dict


def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _to_local(obj):
    if isinstance(obj, DTensor):
        return obj.to_local().detach().cpu()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local(v) for v in obj)
    return obj


@dataclass(frozen=True)
class AdapterIO:
    """How a PEFT-wrapped model's checkpoint is written: the adapter directory's name, the adapter writer
    ``save(model, path)`` and the merged-weights stream ``merged_weights(model) -> (name, tensor)``. LoRA is the
    role's concern (:mod:`verl.workers.lora` registers its functions when imported, which every PEFT model built
    here went through); this module only calls them."""

    dir_name: str
    save: Callable
    merged_weights: Callable


_ADAPTER_IO: list[AdapterIO] = []


def register_adapter_io(io: AdapterIO) -> None:
    _ADAPTER_IO[:] = [io]


def _adapter_io() -> AdapterIO:
    if not _ADAPTER_IO:
        raise RuntimeError("a PEFT model is being checkpointed but no adapter writer is registered "
                           "(verl.workers.lora registers it on import)")
    return _ADAPTER_IO[0]


class FSDPCheckpointManager:
    def __init__(self, model, optimizer=None, lr_scheduler=None, processing_class=None, checkpoint_config=None):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        cfg = checkpoint_config or {}
        self.save_contents = list(cfg.get("save_contents", ["model", "optimizer", "extra"]))
        self.load_contents = list(cfg.get("load_contents", self.save_contents))

    # ---------------------------------------------------------------- save
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep=None, **_) -> None:
        rank, world = _rank_world()
        os.makedirs(local_path, exist_ok=True)
        tag = f"world_size_{world}_rank_{rank}"
        if "model" in self.save_contents:
            atomic_torch_save(_to_local(self.model.state_dict()), os.path.join(local_path, f"model_{tag}.pt"))
        if "optimizer" in self.save_contents and self.optimizer is not None:
            atomic_torch_save(_to_local(self.optimizer.state_dict()), os.path.join(local_path, f"optim_{tag}.pt"))
        if "extra" in self.save_contents:
            extra = {
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            }
            atomic_torch_save(extra, os.path.join(local_path, f"extra_state_{tag}.pt"))
        hf_dir = os.path.join(local_path, "huggingface")
        lora = _is_peft(self.model)
        if lora:
            # PEFT adapter next to the shards, on every save: <local_path>/lora_adapter/adapter_config.json +
            # adapter_model.safetensors (collective gather; rank 0 writes).
            io = _adapter_io()
            io.save(self.model, os.path.join(local_path, io.dir_name))
        full = None
        if "hf_model" in self.save_contents:
            if lora:  # a plain HF model: the adapter merged into the base weights
                full = {k: v.detach().cpu() for k, v in _adapter_io().merged_weights(self.model)}
                full = full if rank == 0 else None
            else:
                full = full_state_dict(self.model)
        if rank == 0:
            os.makedirs(hf_dir, exist_ok=True)
            unwrapped = getattr(self.model, "config", None)
            if unwrapped is not None:
                self.model.config.save_pretrained(hf_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(hf_dir)
            if full is not None:
                save_hf_weights(_base_hf_model(self.model) if lora else self.model, full, hf_dir)
        if dist.is_initialized():
            dist.barrier()

    # ---------------------------------------------------------------- load
    def load_checkpoint(self, local_path: str, **_) -> None:
        rank, world = _rank_world()
        tag = f"world_size_{world}_rank_{rank}"
        model_file = os.path.join(local_path, f"model_{tag}.pt")
        if not os.path.exists(model_file):
            found = sorted(f for f in os.listdir(local_path) if f.startswith("model_")) if os.path.isdir(local_path) else []
            raise FileNotFoundError(
                f"no checkpoint shard {model_file} for world size {world}, rank {rank}; found {found or 'nothing'}. "
                "Resume with the same number of GPUs the checkpoint was saved with."
            )
        if "model" in self.load_contents:
            saved = torch_load(model_file)
            with torch.no_grad():
                for name, t in self.model.state_dict().items():
                    if name not in saved:
                        raise KeyError(f"checkpoint {model_file} has no entry for {name}")
                    local = t.to_local() if isinstance(t, DTensor) else t
                    local.copy_(saved[name].to(local.dtype))
        optim_file = os.path.join(local_path, f"optim_{tag}.pt")
        if "optimizer" in self.load_contents and self.optimizer is not None and os.path.exists(optim_file):
            self._load_optimizer(torch_load(optim_file))
        extra_file = os.path.join(local_path, f"extra_state_{tag}.pt")
        if "extra" in self.load_contents and os.path.exists(extra_file):
            extra = torch_load(extra_file)
            if self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            rng = extra.get("rng") or {}
            if "cpu" in rng:
                torch.set_rng_state(rng["cpu"])
                np.random.set_state(rng["numpy"])
                random.setstate(rng["random"])
                if rng.get("cuda") is not None and torch.cuda.is_available():
                    torch.cuda.set_rng_state_all(rng["cuda"])

    def _load_optimizer(self, saved: dict) -> None:
        """Re-wrap saved local shards as DTensors laid out like their parameters, then load."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for idx, st in saved["state"].items():
            p = params[int(idx)]
            new = {}
            for k, v in st.items():
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0:
                    v = DTensor.from_local(v.to(p.to_local().device), device_mesh=p.device_mesh,
                                           placements=p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                new[k] = v
            state[idx] = new
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def _base_hf_model(model):
    """The HF model inside a PEFT wrapper (for its config and generation config)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def save_hf_weights(model, full_sd: dict[str, torch.Tensor], out_dir: str) -> None:
    """Write a full HF checkpoint (safetensors) from gathered weights, without touching the sharded model."""
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in full_sd.items()}
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        sd = {k: v for k, v in sd.items() if not k.endswith("lm_head.weight")}
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        try:
            gen_cfg.save_pretrained(out_dir)
        except (ValueError, OSError):
            pass
