"""LoRA adapter tensors for a rollout engine that serves the base model plus a separately loaded adapter.

vLLM has no tensor-based LoRA request: an adapter is loaded from a directory in PEFT's saved format. These
helpers produce that directory from the live actor (:func:`write_lora_adapter`) and tell which engine module
an adapted HF module lands in (:func:`engine_lora_module`), so a target the engine cannot serve is reported
before the engine rejects the adapter half-way through a rollout.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch

from .names import PEFT_PREFIX, EngineLayout, engine_targets

_ADAPTER_NAME = "adapter_model.safetensors"
_CONFIG_NAME = "adapter_config.json"
_SAVED = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")


def peft_config_dict(peft_config: Any) -> dict:
    """A PEFT ``LoraConfig`` (or a plain mapping) as the JSON-able dict PEFT writes to adapter_config.json."""
    if isinstance(peft_config, Mapping):
        cfg = dict(peft_config)
    elif hasattr(peft_config, "to_dict"):
        cfg = peft_config.to_dict()
    elif is_dataclass(peft_config):
        cfg = asdict(peft_config)
    else:
        raise TypeError(f"unsupported peft_config type {type(peft_config).__name__}")
    cfg.setdefault("peft_type", "LORA")
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
        elif hasattr(v, "value"):  # enums (peft_type, task_type)
            cfg[k] = v.value
    return cfg


def check_lora_config(peft_config: Any, layout: Optional[EngineLayout] = None) -> dict:
    """Validate what the rollout engine can serve; returns the config dict.

    PEFT ``target_parameters`` (LoRA on fused MoE expert tensors) is refused: under PEFT + transformers 5 it
    has unresolved cases (dropout, FSDP) and no engine loads such adapters — train experts fully instead.
    """
    cfg = peft_config_dict(peft_config)
    if cfg.get("target_parameters"):
        raise NotImplementedError(
            f"LoRA target_parameters={cfg['target_parameters']} (fused MoE experts) cannot be synced to the "
            "rollout engine; target modules (attention, linear attention, shared expert) instead"
        )
    if cfg.get("use_dora"):
        raise NotImplementedError("DoRA adapters are not supported by the rollout weight sync")
    return cfg


def write_lora_adapter(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    peft_config: Any,
) -> Path:
    """Save adapter tensors (PEFT saved names, see ``iter_hf_weights(lora_mode="adapter")``) and config.

    Tensors are written contiguous and on CPU. The directory is what ``LoRARequest(..., lora_path=path)``
    and ``PeftModel.from_pretrained`` read.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in tensors:
        if not _SAVED.match(name):
            raise ValueError(f"{name!r} is not a saved-format LoRA tensor name (<module>.lora_A|lora_B.weight)")
        state[name] = t.detach().to("cpu").contiguous()
    if not state:
        raise ValueError("no LoRA tensors to write")
    save_file(state, str(path / _ADAPTER_NAME), metadata={"format": "pt"})
    cfg = check_lora_config(peft_config)
    (path / _CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    return path


def adapted_modules(tensor_names: Iterable[str]) -> set[str]:
    """HF module paths (no PEFT prefix) that an adapter's saved tensor names touch."""
    out = set()
    for n in tensor_names:
        m = _SAVED.match(n)
        if m:
            mod = m["module"]
            out.add(mod[len(PEFT_PREFIX) :] if mod.startswith(PEFT_PREFIX) else mod)
    return out


def engine_lora_module(hf_module: str, layout: EngineLayout) -> tuple[str, Any]:
    """Engine module (and slice of it) that serves a LoRA on HF module ``hf_module``.

    ``model.layers.3.self_attn.k_proj`` -> (``model.layers.3.self_attn.qkv_proj``, ``"k"``): the engine runs
    one fused matmul, so its adapter is the stack of the three HF adapters.
    """
    targets = engine_targets(hf_module + ".weight", layout)
    if ".mlp.experts" in hf_module or len(targets) != 1:
        raise ValueError(
            f"LoRA on {hf_module!r} has no single engine module (routed experts and modules the engine "
            "drops cannot carry a rollout adapter)"
        )
    engine_param, shard = targets[0]
    return engine_param[: -len(".weight")], shard


def check_engine_lora_targets(
    tensor_names: Iterable[str], layout: EngineLayout, engine_modules: Optional[Iterable[str]] = None
) -> dict[str, tuple[str, Any]]:
    """Map every adapted HF module to its engine module; with ``engine_modules``, require they exist."""
    mapping = {m: engine_lora_module(m, layout) for m in sorted(adapted_modules(tensor_names))}
    if engine_modules is not None:
        known = set(engine_modules)
        absent = sorted(m for m, (eng, _) in mapping.items() if eng not in known)
        if absent:
            raise ValueError(f"LoRA targets with no engine module: {absent[:20]}")
    return mapping
