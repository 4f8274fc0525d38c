"""Megatron engine checkpoints, for exact resume on the same parallel layout.

Two layouts under the role's directory (``global_step_N/actor/``):

* default (``use_dist_checkpointing=false``): per-rank files. ``model_tp{t}_pp{p}_ep{e}_etp{x}.pt`` holds a
  model-parallel shard (written by the first data-parallel replica that owns it), ``optim_rank_{r}.pt`` the
  rank's slice of the distributed optimizer (fp32 master weights and Adam moments, bit-exact), and
  ``extra_state_rank_{r}.pt`` the LR scheduler and every RNG (torch, CUDA, numpy, random and megatron's
  tensor-parallel RNG tracker). Resuming needs the same TP/PP/EP/DP sizes, and the same rank order
  (``rank_order.json``: the per-rank files are keyed by global rank).
* ``use_dist_checkpointing=true``: megatron-core's distributed checkpoint of the model and optimizer in
  ``dist_ckpt/`` (reshardable by megatron-core), extras as above.

``huggingface/`` gets the config and tokenizer on every save and, with ``hf_model`` in
``checkpoint.save_contents``, full HF safetensors gathered from the shards, checked against the source
checkpoint under ``checkpoint.strict`` (:mod:`verl.utils.checkpoint.hf_export`).
"""

from __future__ import annotations

import json
import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

# ``engine`` arguments are the MegatronEngine (verl.workers.engine.megatron.engine), which calls in here; its
# name is only written in annotations so that this module does not import the engine back.

__all__ = ["check_rank_order", "load_checkpoint", "save_checkpoint", "save_hf_checkpoint", "write_rank_order"]

_ORDER_FILE = "rank_order.json"
# The order this engine used before pipeline parallelism moved outermost; it numbered ranks the same way only
# with one pipeline stage or one data-parallel replica.
_OLD_ORDER = "tp-cp-ep-pp-dp"


def _contents(engine: "MegatronEngine", key: str) -> list[str]:
    cfg = engine.checkpoint_config or {}
    default = ["model", "optimizer", "extra"]
    value = cfg.get(key, None) if hasattr(cfg, "get") else None
    if value is None and key == "load_contents":
        value = cfg.get("save_contents", None) if hasattr(cfg, "get") else None
    return list(value if value is not None else default)


def _atomic_save(obj, path: str) -> None:
    from verl.utils.checkpoint.step_dirs import atomic_torch_save

    atomic_torch_save(obj, path)  # a failed write (full disk) leaves no temporary file behind


def _load(path: str):
    from verl.utils.checkpoint.step_dirs import torch_load

    return torch_load(path)  # a truncated file is an error naming it


def write_rank_order(local_path: str) -> None:
    from .layout import RANK_ORDER

    with open(os.path.join(local_path, _ORDER_FILE), "w") as f:
        json.dump({"order": RANK_ORDER}, f)


def check_rank_order(local_path: str, pp: int, dp: int) -> None:
    """Refuse per-rank files (``optim_rank_*``, ``extra_state_rank_*``) written under another rank order: the
    same global rank would hold another shard. Checkpoints without ``rank_order.json`` predate it and used
    ``tp-cp-ep-pp-dp``, which numbers ranks like today's order only with PP 1 or DP 1."""
    from .layout import RANK_ORDER

    path = os.path.join(local_path, _ORDER_FILE)
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f).get("order")
    elif pp > 1 and dp > 1 and os.path.isdir(local_path) and any(
            f.startswith(("optim_rank_", "extra_state_rank_")) for f in os.listdir(local_path)):
        saved = _OLD_ORDER
    else:
        return
    if saved != RANK_ORDER:
        raise ValueError(f"{local_path} was saved with Megatron rank order {saved!r}; this engine numbers ranks "
                         f"{RANK_ORDER!r}, so its per-rank optimizer / RNG files would load into the wrong ranks at "
                         f"pipeline_model_parallel_size={pp} with {dp} data-parallel replicas. Resume it with the "
                         "version that wrote it, or start from its huggingface/ export (actor_rollout_ref.model.path)")


def _coords() -> dict:
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank(),
                edp=ps.get_expert_data_parallel_rank())


def _model_file(path: str, c: dict) -> str:
    return os.path.join(path, f"model_tp{c['tp']}_pp{c['pp']}_ep{c['ep']}_etp{c['etp']}.pt")


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _optimizer_state(optimizer) -> list[dict]:
    out = []
    for opt in _sub_optimizers(optimizer):
        inner = opt.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        out.append({"inner": _cpu(inner.state_dict()), "main_params": [p.detach().cpu() for p in params]})
    return out


def _load_optimizer_state(optimizer, saved: list[dict]) -> None:
    subs = _sub_optimizers(optimizer)
    if len(subs) != len(saved):
        raise RuntimeError(f"checkpoint holds {len(saved)} optimizer parts, the engine has {len(subs)}: the "
                           "parallel layout changed; resume with the layout it was saved with")
    for opt, state in zip(subs, saved):
        inner = opt.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        if len(params) != len(state["main_params"]):
            raise RuntimeError("optimizer parameter count differs from the checkpoint's: layout changed")
        with torch.no_grad():
            for p, saved_p in zip(params, state["main_params"]):
                p.copy_(saved_p.to(p.device))
        inner.load_state_dict(state["inner"])


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(), "numpy": np.random.get_state(),
            "random": random.getstate(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(rng: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(rng["cpu"])
    torch.cuda.set_rng_state(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["random"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


def save_checkpoint(engine: "MegatronEngine", local_path: str, global_step: int = 0,
                    max_ckpt_to_keep: Optional[int] = None) -> None:
    """Write ``local_path`` (the trainer prunes old ``global_step_*`` directories itself)."""
    contents = _contents(engine, "save_contents")
    rank = dist.get_rank()
    os.makedirs(local_path, exist_ok=True)
    if rank == 0:
        write_rank_order(local_path)
    engine.to("device", model=True, optimizer=True, grad=False)
    s = engine.settings
    if s.use_dist_checkpointing and ("model" in contents or "optimizer" in contents):
        _save_dist(engine, os.path.join(local_path, "dist_ckpt"), contents)
    else:
        c = _coords()
        if "model" in contents and c["edp"] == 0:
            _atomic_save([_cpu(m.state_dict()) for m in engine.model], _model_file(local_path, c))
        if "optimizer" in contents and engine.optimizer is not None:
            _atomic_save(_optimizer_state(engine.optimizer), os.path.join(local_path, f"optim_rank_{rank}.pt"))
    if "extra" in contents:
        extra = {"lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                 "rng": _rng_state(), "global_step": global_step}
        _atomic_save(extra, os.path.join(local_path, f"extra_state_rank_{rank}.pt"))
    save_hf_checkpoint(engine, os.path.join(local_path, "huggingface"), weights="hf_model" in contents)
    engine._offload_idle()
    dist.barrier()


def load_checkpoint(engine: "MegatronEngine", local_path: str) -> None:
    contents = _contents(engine, "load_contents")
    rank = dist.get_rank()
    s = engine.settings
    check_rank_order(local_path, s.pp, engine.dp_size)
    engine.to("device", model=True, optimizer=True, grad=False)
    if s.use_dist_checkpointing and ("model" in contents or "optimizer" in contents):
        _load_dist(engine, os.path.join(local_path, "dist_ckpt"), contents)
    else:
        c = _coords()
        if "model" in contents:
            path = _model_file(local_path, c)
            if not os.path.exists(path):
                have = sorted(f for f in os.listdir(local_path) if f.startswith("model_")) \
                    if os.path.isdir(local_path) else []
                raise FileNotFoundError(f"{path} not found (have {have}): Megatron checkpoints resume only on the "
                                        "tensor/pipeline/expert layout they were saved with")
            states = _load(path)
            for m, sd in zip(engine.model, states):
                m.load_state_dict(sd, strict=True)
        if "optimizer" in contents and engine.optimizer is not None:
            path = os.path.join(local_path, f"optim_rank_{rank}.pt")
            _load_optimizer_state(engine.optimizer, _load(path))
        elif "model" in contents and engine.optimizer is not None:
            engine.optimizer.reload_model_params()  # fp32 master weights follow the loaded model
    if "extra" in contents:
        path = os.path.join(local_path, f"extra_state_rank_{rank}.pt")
        extra = _load(path)
        if extra.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        _set_rng_state(extra["rng"])
    engine._offload_idle()
    dist.barrier()


# ------------------------------------------------------------------------------------ dist checkpointing
def _save_dist(engine: "MegatronEngine", path: str, contents: list[str]) -> None:
    from megatron.core import dist_checkpointing

    state = _dist_state(engine, contents)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path)


def _dist_state(engine: "MegatronEngine", contents: list[str], is_loading: bool = False) -> dict:
    from verl.utils.megatron_utils import unwrap_model

    # The unwrapped model's keys: the same checkpoint loads with or without DDP (the reference engine).
    model_sd = {f"model{i}": unwrap_model(m).sharded_state_dict() for i, m in enumerate(engine.model)}
    state = dict(model_sd) if "model" in contents else {}
    if "optimizer" in contents and engine.optimizer is not None:
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def _load_dist(engine: "MegatronEngine", path: str, contents: list[str]) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_dist_state(engine, contents, is_loading=True), path)
    if "model" in contents:
        from verl.utils.megatron_utils import unwrap_model

        for i, m in enumerate(engine.model):
            unwrap_model(m).load_state_dict(state[f"model{i}"], strict=True)
    if "optimizer" in state and engine.optimizer is not None:
        engine.optimizer.load_state_dict(state["optimizer"])
    elif engine.optimizer is not None:
        engine.optimizer.reload_model_params()  # fp32 master weights follow the loaded model


# ------------------------------------------------------------------------------------ HF export
def save_hf_checkpoint(engine: "MegatronEngine", out_dir: str, weights: bool = True) -> None:
    """Config (+ tokenizer files of the source checkpoint) and, with ``weights``, full HF safetensors."""
    from .weights import iter_hf_weights

    rank = dist.get_rank()
    full = {}
    if weights:
        for name, tensor in iter_hf_weights(engine):
            if rank == 0:
                full[name] = tensor.detach().to("cpu").contiguous()
    if rank != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    engine.hf_config.save_pretrained(out_dir)
    if engine.processing_class is not None:
        engine.processing_class.save_pretrained(out_dir)
    else:
        _copy_tokenizer_files(engine, out_dir)
    if weights:
        from safetensors.torch import save_file

        full = _checked_export(engine, full)
        tmp = os.path.join(out_dir, "model.safetensors.tmp")
        save_file(full, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, "model.safetensors"))


def _checked_export(engine: "MegatronEngine", full: dict) -> dict:
    """``<role>.checkpoint.strict`` (upstream's default true): the export must hold exactly the tensors of the
    source checkpoint (``model.path``); false writes the ones the source has and skips the rest. A tied LM head
    is left out first, as Hugging Face's own save does (the source never stores it)."""
    from verl.models.mcore.config_converter import tie_word_embeddings
    from verl.utils.checkpoint.hf_export import reconcile_export, source_tensor_names

    if tie_word_embeddings(engine.hf_config):
        full = {k: v for k, v in full.items() if not k.endswith("lm_head.weight")}
    cfg = engine.checkpoint_config
    strict = cfg.get("strict", True) if hasattr(cfg, "get") else True
    return reconcile_export(full, source_tensor_names(engine.model_path), bool(strict),
                            f"{engine.role_spec.section}.checkpoint.strict")


def _copy_tokenizer_files(engine: "MegatronEngine", out_dir: str) -> None:
    """Tokenizer files of the source checkpoint (``model.tokenizer_path`` where set, else ``model.path``),
    hub ids resolved through the HF cache as when the tokenizer was loaded; a source that cannot be resolved
    is an error, never a silently tokenizer-less export."""
    import shutil

    from verl.utils.model_path import model_config_dir

    cfg = engine.model_config
    section = getattr(engine, "_model_section", "actor_rollout_ref.model")
    if (cfg.get("tokenizer_path") if hasattr(cfg, "get") else None):
        src = model_config_dir(cfg, key="tokenizer_path", what=f"{section}.tokenizer_path", use_shm=False)
    else:
        src = engine.model_path
    prefixes = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation_config")
    for name in sorted(os.listdir(src)):
        if name.startswith(prefixes) and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(out_dir, name))
