"""Reading HF safetensors one tensor at a time and copying chunk-local mcore state into a model chunk (pure
torch; re-exported by :mod:`verl.models.mcore.weight_converter`)."""

from __future__ import annotations

from typing import Callable, Mapping

import torch


def safetensors_getter(path: str) -> Callable[[str], torch.Tensor]:
    """Getter over a checkpoint directory's ``*.safetensors`` files that reads one tensor at a time."""
    import glob
    import os

    from safetensors import safe_open

    from verl.models.mcore.weight_converter import hf_getter  # lazy: weight_converter re-exports this module

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    where: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            for key in handle.keys():
                where[key] = f
    lookup = {k: None for k in where}

    def raw(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt") as handle:
            return handle.get_tensor(name)

    class _Lazy(dict):  # a Mapping whose values load on access, so hf_getter's fused-expert fallback works
        def __getitem__(self, key):
            return raw(key)

    return hf_getter(_Lazy(lookup))


@torch.no_grad()
def load_mcore_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor], keep_init: tuple = ()) -> None:
    """Copy a chunk-local state dict into a model chunk; every parameter must be covered exactly once, except
    those under a ``keep_init`` prefix (e.g. a critic's fresh value head), which may be absent."""
    from verl.models.mcore.weight_converter import strip_wrapper_prefix
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
