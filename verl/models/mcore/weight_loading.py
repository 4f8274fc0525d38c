"""Reading HF safetensors one tensor at a time and copying chunk-local mcore state into a model chunk (pure
torch, model-independent; each architecture's weight converter re-exports these)."""

from __future__ import annotations

import re
from typing import Callable, Mapping

import torch


def safetensors_getter(path: str) -> Callable[[str], torch.Tensor]:
    """Getter over a checkpoint directory's ``*.safetensors`` files that reads one tensor at a time."""
    import glob
    import os

    from safetensors import safe_open


    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    where: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            for key in handle.keys():
                where[key] = f
    lookup = {k: None for k in where}
    # One open handle per file for the getter's life: opening parses the file's whole header, ~4 ms per tensor
    # read for a file of 6,000 tensors (CPU, 2026-11-28) -- 25-70 s per engine for Qwen3.5-35B-A3B's thousands
    # of expert tensors, against ~10 us per read through a kept handle.
    handles: dict = {}

    def raw(name: str) -> torch.Tensor:
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(f, framework="pt")
        return handles[f].get_tensor(name)

    class _Lazy(dict):  # a Mapping whose values load on access, so hf_getter's fused-expert fallback works
        def __getitem__(self, key):
            return raw(key)

    return hf_getter(_Lazy(lookup))


@torch.no_grad()
def load_mcore_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor], keep_init: tuple = ()) -> None:
    """Copy a chunk-local state dict into a model chunk; every parameter must be covered exactly once, except
    those under a ``keep_init`` prefix (e.g. a critic's fresh value head), which may be absent."""
    params = {strip_wrapper_prefix(n): p for n, p in module.named_parameters()}
    missing = sorted(n for n in set(params) - set(state) if not n.startswith(tuple(keep_init)))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise KeyError(f"mcore state does not match the model: missing {missing[:8]}, unexpected {extra[:8]}")
    for name, p in params.items():
        if name not in state:
            continue
        src = state[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != parameter shape {tuple(p.shape)}")
        p.copy_(src.to(device=p.device, dtype=p.dtype))


def strip_wrapper_prefix(name: str) -> str:
    """Drop the ``module.`` segments that DDP / Float16Module wrappers put in front of parameter names."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


PER_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def hf_getter(state: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """A getter over an HF state dict in checkpoint layout (per-expert names) or module layout (fused experts)."""

    def get(name: str) -> torch.Tensor:
        if name in state:
            return state[name]
        m = PER_EXPERT_RE.match(name)
        if m is not None:
            base, e, which = m.group(1), int(m.group(2)), m.group(3)
            if which == "down" and base + ".down_proj" in state:
                return state[base + ".down_proj"][e]
            if which in ("gate", "up") and base + ".gate_up_proj" in state:
                gate, up = state[base + ".gate_up_proj"][e].chunk(2, dim=0)
                return gate if which == "gate" else up
        raise KeyError(f"{name} is missing from the Hugging Face checkpoint")

    return get
