"""PEFT LoRA for the FSDP2 actor, with the Qwen3.5 specifics spelled out.

Entry points used by the workers:

* :func:`apply_lora` wraps the freshly loaded HF model in a PEFT ``PeftModel`` (before FSDP2 sharding); only
  adapter parameters stay trainable. With ``lora_adapter_path`` the adapter is loaded from disk and its
  ``adapter_config.json`` decides rank and alpha.
* :func:`save_lora_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's format).
* :func:`rollout_sync` chooses how a separate rollout engine (vLLM) receives the trained policy: the adapter
  tensors alone, or base weights with the adapter merged in when the engine cannot serve the adapter
  (fused-expert LoRA).
* :func:`check_lora_rollout_config` rejects settings under which the rollout engine would silently serve a
  model other than the one being trained.

Which modules ``target_modules=all-linear`` selects on Qwen3.5 (text and MoE, dense and VL checkpoints):

=====================  ===========================================================  ==========
block                  modules                                                      LoRA
=====================  ===========================================================  ==========
full attention         ``self_attn.q_proj k_proj v_proj o_proj``                    yes
Gated DeltaNet         ``linear_attn.in_proj_qkv in_proj_z in_proj_b in_proj_a``    yes
                       ``linear_attn.out_proj``                                     yes
                       ``linear_attn.conv1d`` (depthwise Conv1d)                    no
dense MLP              ``mlp.gate_proj up_proj down_proj``                          yes
MoE shared expert      ``mlp.shared_expert.gate_proj up_proj down_proj``            yes
MoE router / gates     ``mlp.gate``, ``mlp.shared_expert_gate``                     no
MoE routed experts     ``mlp.experts.gate_up_proj / down_proj`` (3-D parameters)    opt-in
output / embeddings    ``lm_head``, ``embed_tokens``                                no
vision tower           ``model.visual.*``                                           no
=====================  ===========================================================  ==========

Routed experts are fused ``nn.Parameter`` tensors in transformers 5 (``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``), not ``nn.Linear`` modules, so module matching cannot reach them. They are
trained through PEFT's ``target_parameters`` (``actor_rollout_ref.model.target_parameters``), which only
works with ``lora_dropout=0``: the dropout would have to act on the expert inputs, which a weight-space
update cannot express.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

ADAPTER_DIR_NAME = "lora_adapter"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
LORA_INT_ID = 1

from verl.utils.config import cfg_get, to_plain  # noqa: E402

# The per-architecture lists live in the model spec (``ModelSpec.lora_all_linear`` / ``lora_fused_expert_params``,
# e.g. verl/models/qwen3_5/spec.py). A model whose spec names no fused expert tensors is looked up under
# transformers 5's own fused-experts names.
FUSED_EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Spellings of target_parameters that mean "both fused expert tensors".
EXPERT_ALIASES = ("all-experts", "experts")

FUSED_EXPERT_DROPOUT_ERROR = (
    "LoRA on fused MoE experts (target_parameters={targets}) needs actor_rollout_ref.model.lora_dropout=0, got "
    "{dropout}. PEFT applies expert LoRA as a weight-space update, which cannot drop out the expert inputs. "
    "What works: (a) keep the experts and set actor_rollout_ref.model.lora_dropout=0, or (b) keep the dropout "
    "and drop the experts with actor_rollout_ref.model.target_parameters=null (attention, Gated DeltaNet and "
    "shared-expert projections are still adapted)."
)


def _plain(value: Any) -> Any:
    """OmegaConf containers -> plain Python (PEFT stores and JSON-serialises these)."""
    value = to_plain(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _log(msg: str) -> None:
    """LoRA decisions are shown to the user (rank 0 prints) and logged."""
    logger.info(msg)
    if _rank0():
        print(f"[verl.lora] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- config
def lora_enabled(model_cfg: Any) -> bool:
    """LoRA is on when ``lora_rank > 0`` or an adapter to start from is given (its rank then applies)."""
    return int(cfg_get(model_cfg, "lora_rank", 0) or 0) > 0 or bool(cfg_get(model_cfg, "lora_adapter_path"))


def lora_merge(model_cfg: Any) -> bool:
    """``model.lora.merge`` (upstream's key): the rollout engine gets base weights with the adapter merged in."""
    return bool(cfg_get(cfg_get(model_cfg, "lora"), "merge", False))


def rollout_lora_rank(model_cfg: Any) -> int:
    """The LoRA rank the rollout engine is built for: ``lora_rank``, or 0 under ``lora.merge`` (it then gets full
    merged weights and runs without LoRA, as upstream's vLLM server does)."""
    return 0 if lora_merge(model_cfg) else int(cfg_get(model_cfg, "lora_rank", 0) or 0)


def read_adapter_config(path: str) -> dict:
    cfg_file = os.path.join(os.path.expanduser(str(path)), ADAPTER_CONFIG_NAME)
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(
            f"actor_rollout_ref.model.lora_adapter_path={path!r} has no {ADAPTER_CONFIG_NAME}; point it at a "
            f"directory with {ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME} (e.g. a checkpoint's "
            f"global_step_N/actor/{ADAPTER_DIR_NAME})"
        )
    with open(cfg_file) as f:
        return json.load(f)


def _spec(model: nn.Module):
    from verl.models.registry import get_model_spec

    cfg = getattr(model, "config", None)
    return get_model_spec(cfg) if cfg is not None else None


def _language_linear_paths(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".visual." not in f".{n}."
            and not n.startswith("visual.")]


def resolve_target_modules(model: nn.Module, target_modules: Any) -> Any:
    """What PEFT's ``target_modules`` gets. ``all-linear`` becomes the explicit Qwen3.5 list (table above)."""
    target_modules = _plain(target_modules)
    if target_modules is None or target_modules == "all-linear" or target_modules == ["all-linear"]:
        spec = _spec(model)
        if spec is None or spec.lora_all_linear is None:
            return "all-linear"  # PEFT's own rule: every Linear except the output layer
        present = {p.rsplit(".", 1)[-1] for p in _language_linear_paths(model)}
        leaves = [leaf for leaf in spec.lora_all_linear if leaf in present]
        if not leaves:
            raise ValueError(f"target_modules=all-linear matched no projection of this {spec.architecture} model")
        return leaves
    if isinstance(target_modules, str):
        return target_modules  # a regular expression, matched by PEFT against full module names
    if not isinstance(target_modules, list) or not all(isinstance(t, str) for t in target_modules):
        raise ValueError(f"target_modules must be 'all-linear', a regex string or a list of names, got {target_modules!r}")
    expert_params = {n for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n}
    fused = [t for t in target_modules if any(n == t or n.endswith("." + t) for n in expert_params)]
    if fused:
        raise ValueError(
            f"target_modules={fused} names fused MoE expert parameters, which are not modules; list them in "
            f"actor_rollout_ref.model.target_parameters instead (e.g. {list(FUSED_EXPERT_PARAMS)})"
        )
    return target_modules


def resolve_target_parameters(model: nn.Module, target_parameters: Any) -> Optional[list[str]]:
    """PEFT ``target_parameters`` (fused expert tensors); ``all-experts`` means both of Qwen3.5-MoE's."""
    target_parameters = _plain(target_parameters)
    if target_parameters in (None, "", [], "none", "null"):
        return None
    if isinstance(target_parameters, str):
        target_parameters = [target_parameters]
    spec = _spec(model)
    fused = (spec.lora_fused_expert_params if spec is not None else ()) or FUSED_EXPERT_PARAMS
    out: list[str] = []
    for t in target_parameters:
        out.extend(fused if t in EXPERT_ALIASES else [t])
    names = [n for n, p in model.named_parameters() if p.dim() >= 2]
    missing = [t for t in out if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"target_parameters {missing} match no parameter of this model"
            + ("; it has no fused MoE experts (a dense model)" if not any(".experts." in n for n in names) else "")
        )
    return out


def _check_dropout(target_parameters: Optional[list[str]], dropout: float) -> None:
    if target_parameters and float(dropout or 0.0) > 0.0:
        raise ValueError(FUSED_EXPERT_DROPOUT_ERROR.format(targets=list(target_parameters), dropout=dropout))


def build_lora_config(model: nn.Module, model_cfg: Any):
    from peft import LoraConfig, TaskType

    rank = int(cfg_get(model_cfg, "lora_rank", 0))
    target_parameters = resolve_target_parameters(model, cfg_get(model_cfg, "target_parameters"))
    dropout = float(cfg_get(model_cfg, "lora_dropout", 0.0))
    _check_dropout(target_parameters, dropout)
    kwargs = dict(
        r=rank,
        lora_alpha=cfg_get(model_cfg, "lora_alpha", 16),
        target_modules=resolve_target_modules(model, cfg_get(model_cfg, "target_modules", "all-linear")),
        exclude_modules=_plain(cfg_get(model_cfg, "exclude_modules")),
        lora_dropout=dropout,
        bias="none",
        task_type=TaskType.CAUSAL_LM,
    )
    if target_parameters:
        kwargs["target_parameters"] = target_parameters
    return LoraConfig(**kwargs)


def _set_cfg(model_cfg: Any, **values) -> None:
    """Write resolved values back so later readers (the rollout engine's ``max_lora_rank``) agree."""
    try:
        from omegaconf import DictConfig, open_dict

        if isinstance(model_cfg, DictConfig):
            with open_dict(model_cfg):
                for k, v in values.items():
                    model_cfg[k] = v
            return
    except ImportError:  # pragma: no cover
        pass
    for k, v in values.items():
        try:
            model_cfg[k] = v
        except TypeError:
            setattr(model_cfg, k, v)


def apply_lora(model: nn.Module, model_cfg: Any) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA as ``model_cfg`` says; only adapter parameters remain trainable."""
    from peft import PeftModel, get_peft_model

    adapter_path = cfg_get(model_cfg, "lora_adapter_path")
    if adapter_path:
        from verl.utils.fs import copy_to_local

        local = copy_to_local(adapter_path, use_shm=bool(cfg_get(model_cfg, "use_shm", False)))
        saved = read_adapter_config(local)
        r, alpha = int(saved.get("r", 0)), saved.get("lora_alpha")
        cfg_r, cfg_alpha = int(cfg_get(model_cfg, "lora_rank", 0)), cfg_get(model_cfg, "lora_alpha", 16)
        if (cfg_r and cfg_r != r) or cfg_alpha != alpha:
            _log(f"lora_adapter_path={adapter_path}: rank={r} and alpha={alpha} from its {ADAPTER_CONFIG_NAME} "
                 f"override the config's lora_rank={cfg_r}, lora_alpha={cfg_alpha}")
        _check_dropout(saved.get("target_parameters"), saved.get("lora_dropout", 0.0))
        _set_cfg(model_cfg, lora_rank=r, lora_alpha=alpha)
        model = PeftModel.from_pretrained(model, local, is_trainable=True)
        peft_cfg = model.peft_config["default"]
        if isinstance(peft_cfg.task_type, str):
            from peft import TaskType

            peft_cfg.task_type = TaskType.CAUSAL_LM
        _log(f"loaded LoRA adapter from {adapter_path} (r={r}, alpha={alpha}) and continue training it")
    else:
        model = get_peft_model(model, build_lora_config(model, model_cfg))
        from verl.workers.lora_init import init_fresh_adapter

        init_fresh_adapter(model, cfg_get(model_cfg, "lora"))
    # FSDP2 shards each layer as one group: the adapter must share the base weights' dtype.
    base_dtype = next((p.dtype for p in model.parameters() if not p.requires_grad), None)
    for p in model.parameters():
        if p.requires_grad and base_dtype is not None and p.dtype != base_dtype:
            p.data = p.data.to(base_dtype)
    _route_generate_through_fsdp_root(model)
    bad = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    if bad:
        raise RuntimeError(f"LoRA left non-adapter parameters trainable: {bad[:5]}")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    peft_cfg = model.peft_config["default"]
    targets = peft_cfg.target_modules
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
    _log(f"LoRA r={peft_cfg.r} alpha={peft_cfg.lora_alpha} dropout={peft_cfg.lora_dropout} "
         f"target_modules={targets} target_parameters={peft_cfg.target_parameters or None}; "
         f"trainable {trainable:,} of {total:,} parameters ({100.0 * trainable / max(total, 1):.3f}%)")
    return model


def _route_generate_through_fsdp_root(model: nn.Module) -> None:
    """Make ``PeftModel.generate`` safe once the PeftModel is the FSDP2 root.

    ``PeftModel.generate`` calls the inner HF model's ``generate``, whose forwards never pass through the
    PeftModel's own ``forward``, so the FSDP2 root's pre-forward hook (which gathers the root-owned
    parameters: norm, tied embeddings / lm_head) never runs and those stay sharded. The wrapper gathers
    them around ``generate`` (the hf rollout engine generates with the live actor this way).
    """
    inner = model.generate

    def generate(*args, **kwargs):
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            FSDPModule = ()
        if not isinstance(model, FSDPModule):
            return inner(*args, **kwargs)
        model._get_fsdp_state()._lazy_init()
        model.unshard()
        try:
            return inner(*args, **kwargs)
        finally:
            model.reshard()

    model.generate = generate


# --------------------------------------------------------------------------------------------- adapters
def is_peft_model(module: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, PeftModel)


def peft_config_of(module: nn.Module):
    return module.peft_config["default"]


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as PEFT saves it (names without the adapter name), gathered to full CPU tensors.

    Every rank must call this (gathering a sharded tensor is a collective); all ranks get the result.
    """
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    sd = get_peft_model_state_dict(module, state_dict=module.state_dict())
    out = {}
    for k in sorted(sd):
        t = sd[k]
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[k] = t.detach().to("cpu").contiguous()
    return out


def save_lora_adapter(module: nn.Module, out_dir: str) -> Optional[str]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` to ``out_dir`` (collective; rank 0 writes).

    The directory loads with ``peft.PeftModel.from_pretrained(base_model, out_dir)`` and is a valid
    ``lora_adapter_path`` to continue training from.
    """
    from safetensors.torch import save_file

    sd = adapter_state_dict(module)
    if not _rank0():
        return None
    os.makedirs(out_dir, exist_ok=True)
    cfg = peft_config_of(module)
    tmp = os.path.join(out_dir, ADAPTER_WEIGHTS_NAME + ".tmp")
    save_file(sd, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, ADAPTER_WEIGHTS_NAME))
    base = getattr(getattr(module, "config", None), "_name_or_path", None)
    old_base = cfg.base_model_name_or_path
    if base and not old_base:
        cfg.base_model_name_or_path = base
    cfg.save_pretrained(out_dir)  # writes adapter_config.json
    return out_dir


# ------------------------------------------------------------------------------------------ rollout sync
def check_lora_rollout_config(actor_rollout_ref_cfg: Any) -> None:
    """Fail early on settings under which the rollout engine would not serve the trained LoRA policy."""
    model_cfg = cfg_get(actor_rollout_ref_cfg, "model")
    rollout_cfg = cfg_get(actor_rollout_ref_cfg, "rollout")
    if not lora_enabled(model_cfg) or rollout_cfg is None:
        return
    name = str(cfg_get(rollout_cfg, "name", "hf"))
    if name == "hf":
        return  # generates with the live actor module: nothing to load, any load_format works
    if lora_merge(model_cfg):
        return  # full merged weights are synced: the engine may start from dummy weights
    fmt = str(cfg_get(rollout_cfg, "load_format", "dummy"))
    if fmt.startswith("dummy"):
        raise ValueError(
            f"actor_rollout_ref.rollout.load_format={fmt} with LoRA and rollout.name={name}: the engine would start "
            "from random weights, and with LoRA only the adapter is sent to it afterwards, so the base weights "
            "would never arrive. Set actor_rollout_ref.rollout.load_format=safetensors (the engine then reads the "
            "base model from actor_rollout_ref.model.path)."
        )


def fused_expert_wrappers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora.layer import ParamWrapper

    return [m for m in module.modules() if isinstance(m, ParamWrapper)]


def rollout_lora_mode(module: nn.Module, merge: bool = False) -> str:
    """``adapter`` (send adapter tensors, the engine applies them) or ``merged`` (send merged full weights).

    ``merge`` (``model.lora.merge``) asks for merged weights. Adapters on fused MoE experts (PEFT
    ``target_parameters``) have no engine counterpart, so those runs send merged weights too; everything else
    sends the adapter.
    """
    if not is_peft_model(module) or merge:
        return "merged"
    return "merged" if fused_expert_wrappers(module) else "adapter"


def _strip_peft(name: str) -> str:
    from verl.workers.weight_sync.names import strip_wrapper_names

    return strip_wrapper_names(name)


def _expert_delta(wrapper: nn.Module, adapter: str) -> torch.Tensor:
    """``scaling * B @ A`` per expert, shaped like the wrapped 3-D parameter (full tensors, fp32)."""
    from verl.workers.weight_sync.gather import full_tensor

    a = full_tensor(wrapper.lora_A[adapter].weight.detach()).float()
    b = full_tensor(wrapper.lora_B[adapter].weight.detach()).float()
    e = int(wrapper.num_experts)
    a = a.reshape(e, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, e)  # [out, r, E]
    if wrapper._did_swap_in_out_features:  # parameter stored [E, out, in]
        delta = torch.einsum("ore,eri->eoi", b, a)
    else:  # parameter stored [E, in, out]
        delta = torch.einsum("ore,eri->eio", b, a)
    return delta * float(wrapper.scaling[adapter])


def iter_merged_weights(module: nn.Module, bucket_megabytes: float = 512, layered: bool = False,
                        dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full weights with every LoRA (Linear and fused-expert) folded in.

    Linear LoRAs are merged by the weight-sync gatherer; fused-expert wrappers (PEFT ``ParamWrapper``, which
    nest one per targeted tensor) are merged here. Collective like ``iter_hf_weights``.
    """
    from verl.workers.weight_sync import iter_hf_weights

    expert_targets: dict[str, tuple[nn.Module, str]] = {}
    for path, sub in module.named_modules():
        if type(sub).__name__ == "ParamWrapper":
            clean = _strip_peft(path).replace(".base_layer", "")
            adapters = [a for a in sub.lora_A.keys() if a in sub.active_adapters]
            if len(adapters) != 1:
                raise NotImplementedError(f"{path}: merging needs exactly one active adapter, got {adapters}")
            expert_targets[f"{clean}.{sub.parameter_name}"] = (sub, adapters[0])
    for name, tensor in iter_hf_weights(module, bucket_megabytes=bucket_megabytes, layered=layered,
                                        lora_mode="merged", dtype=None):
        clean = name.replace(".base_layer", "")
        hit = expert_targets.get(clean)
        if hit is not None:
            tensor = (tensor.float() + _expert_delta(*hit).to(tensor.device)).to(tensor.dtype)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield clean, tensor


def rollout_sync(module: nn.Module, bucket_megabytes: float = 512, layered: bool = False,
                 dtype: Optional[torch.dtype] = None,
                 merge: bool = False) -> tuple[Iterable[tuple[str, torch.Tensor]], dict]:
    """``(weights, update_weights kwargs)`` for an engine that loads weights (vLLM) from a LoRA actor.

    Adapter mode yields PEFT-named adapter tensors with ``lora={"peft_config", "lora_int_id"}``; merged mode
    yields full HF weights and no kwargs. The choice is made by :func:`rollout_lora_mode` and logged once.
    """
    from verl.workers.weight_sync import iter_hf_weights

    mode = rollout_lora_mode(module, merge=merge)
    if getattr(module, "_verl_lora_sync_logged", None) != mode:
        why = ("model.lora.merge=true" if merge else "LoRA on fused MoE experts has no engine-side adapter"
               if mode == "merged" else "the engine applies the adapter on top of the base weights it loaded")
        _log(f"rollout weight sync: LoRA mode '{mode}' ({why})")
        module._verl_lora_sync_logged = mode
    if mode == "merged":
        return iter_merged_weights(module, bucket_megabytes, layered, dtype), {}
    weights = iter_hf_weights(module, bucket_megabytes=bucket_megabytes, layered=layered, lora_mode="adapter",
                              dtype=dtype)
    return weights, {"lora": {"peft_config": peft_config_of(module), "lora_int_id": LORA_INT_ID}}


# ------------------------------------------------------------------------------------------------ merge
def merge_adapter_into(base: nn.Module, adapter_dir: str) -> nn.Module:
    """Load the adapter at ``adapter_dir`` onto ``base`` and fold it in; returns the plain HF model."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


__all__ = [
    "ADAPTER_DIR_NAME",
    "FUSED_EXPERT_DROPOUT_ERROR",
    "FUSED_EXPERT_PARAMS",
    "adapter_state_dict",
    "apply_lora",
    "build_lora_config",
    "check_lora_rollout_config",
    "is_peft_model",
    "iter_merged_weights",
    "lora_enabled",
    "lora_merge",
    "merge_adapter_into",
    "read_adapter_config",
    "resolve_target_modules",
    "resolve_target_parameters",
    "rollout_lora_mode",
    "rollout_lora_rank",
    "rollout_sync",
    "save_lora_adapter",
]


def _register_checkpoint_io() -> None:
    # The FSDP checkpoint manager (verl.utils, which may not import workers) saves PEFT models through these.
    from verl.utils.checkpoint.fsdp_checkpoint_manager import AdapterIO, register_adapter_io

    register_adapter_io(AdapterIO(ADAPTER_DIR_NAME, save_lora_adapter, iter_merged_weights))


_register_checkpoint_io()
