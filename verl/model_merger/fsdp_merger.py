"""Rebuild a full HF model from this project's FSDP2 actor checkpoints (see ``FSDPCheckpointManager``)."""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Optional

import torch

_SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "preprocessor_config.json", "processor_config.json",
                    "video_preprocessor_config.json", "added_tokens.json")


def _shard_files(local_dir: str) -> list[str]:
    found = {}
    for path in glob.glob(os.path.join(local_dir, "model_world_size_*_rank_*.pt")):
        m = _SHARD.match(os.path.basename(path))
        if m:
            found.setdefault(int(m[1]), {})[int(m[2])] = path
    if not found:
        raise FileNotFoundError(f"no model_world_size_*_rank_*.pt shards in {local_dir}")
    if len(found) > 1:
        raise ValueError(f"{local_dir} mixes shards of several world sizes: {sorted(found)}")
    (world, ranks), = found.items()
    if sorted(ranks) != list(range(world)):
        raise FileNotFoundError(f"{local_dir}: expected ranks 0..{world - 1}, found {sorted(ranks)}")
    return [ranks[r] for r in range(world)]


def _build_model(local_dir: str, trust_remote_code: bool, hf_model_path: Optional[str] = None):
    from transformers import AutoConfig

    from verl.models.registry import get_model_class

    if hf_model_path:
        from verl.models.registry import load_hf_model

        return load_hf_model(hf_model_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    cfg_dir = os.path.join(local_dir, "huggingface")
    config = AutoConfig.from_pretrained(cfg_dir, trust_remote_code=trust_remote_code)
    cls = get_model_class(config, trust_remote_code=trust_remote_code)
    if cls.__name__.startswith("Auto"):
        model = cls.from_config(config, trust_remote_code=trust_remote_code)
    else:
        model = cls._from_config(config)
    return model.to(torch.float32)


def load_actor_state(local_dir: str, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full tensors from the per-rank shards; FSDP2 shards parameters along dim 0."""
    shards = [torch.load(f, map_location="cpu", weights_only=False) for f in _shard_files(local_dir)]
    out = {}
    for name, t0 in shards[0].items():
        want = expected.get(name)
        if len(shards) == 1 or want is None or tuple(t0.shape) == tuple(want):
            out[name] = t0
        else:
            out[name] = torch.cat([s[name] for s in shards], dim=0)
        if want is not None and tuple(out[name].shape) != tuple(want):
            raise ValueError(f"{name}: rebuilt shape {tuple(out[name].shape)} != model shape {tuple(want)}")
    return out


def merged_model(local_dir: str, hf_model_path: Optional[str] = None, trust_remote_code: bool = False):
    """The actor as a plain HF model (adapter folded in for LoRA checkpoints)."""
    local_dir = os.path.abspath(os.path.expanduser(local_dir))
    adapter_dir = os.path.join(local_dir, "lora_adapter")
    is_lora = os.path.isfile(os.path.join(adapter_dir, "adapter_config.json"))
    model = _build_model(local_dir, trust_remote_code, hf_model_path)
    if is_lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
        if hf_model_path is None:  # base and adapter weights both come from the shards
            _load(model, local_dir)
        return model.merge_and_unload()
    if hf_model_path is not None:
        raise ValueError("--hf_model_path only applies to LoRA checkpoints (an actor/lora_adapter directory)")
    _load(model, local_dir)
    return model


def _load(model, local_dir: str) -> None:
    sd = model.state_dict()
    state = load_actor_state(local_dir, {k: v.shape for k, v in sd.items()})
    missing = [k for k in sd if k not in state]
    unexpected = [k for k in state if k not in sd]
    if missing or unexpected:
        raise KeyError(f"checkpoint/model mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, v in sd.items():
            v.copy_(state[k].to(v.dtype))


def merge_fsdp_checkpoint(local_dir: str, target_dir: str, hf_model_path: Optional[str] = None,
                          trust_remote_code: bool = False, dtype: Optional[str] = None) -> str:
    model = merged_model(local_dir, hf_model_path, trust_remote_code)
    want = _DTYPES[dtype] if dtype else getattr(model.config, "dtype", None)
    if isinstance(want, str):
        want = _DTYPES.get(want.replace("torch.", ""), torch.float32)
    model = model.to(want if isinstance(want, torch.dtype) else torch.float32)
    os.makedirs(target_dir, exist_ok=True)
    model.save_pretrained(target_dir, safe_serialization=True)
    hf_dir = os.path.join(local_dir, "huggingface")
    for name in _TOKENIZER_FILES:
        src = os.path.join(hf_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(target_dir, name))
    return target_dir


def compare_with_hf(local_dir: str, test_hf_dir: str, hf_model_path: Optional[str] = None,
                    trust_remote_code: bool = False, atol: float = 1e-5) -> list[str]:
    from verl.models.registry import load_hf_model

    got = merged_model(local_dir, hf_model_path, trust_remote_code).state_dict()
    ref = load_hf_model(test_hf_dir, dtype=torch.float32, trust_remote_code=trust_remote_code).state_dict()
    bad = sorted(set(got) ^ set(ref))
    for k in sorted(set(got) & set(ref)):
        if got[k].shape != ref[k].shape or not torch.allclose(got[k].float(), ref[k].float(), atol=atol):
            bad.append(k)
    return bad
