"""Which fast kernels a model runs with, said once at start-up, and a warning for each one missing on CUDA.

The Qwen3.5 forwards fall back to exact torch code when a kernel package is absent (that is what the CPU CI
runs), so a missing package never fails a run; on a GPU it costs time, which users must hear about rather
than discover (a silent torch fallback of the Gated DeltaNet delta rule has cost users 2x elsewhere).

The model spec says what a model needs (``has_linear_attention``, packing); this module knows which package
provides each kernel and what its absence costs.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernel:
    package: str  # pip name
    module: str  # import name
    used_for: str
    fallback_cost: str


KERNELS = {
    "fla": Kernel("flash-linear-attention", "fla",
                  "Gated DeltaNet chunked delta rule and varlen causal conv (packed and padded training forwards)",
                  "the torch reference runs the delta rule as a per-chunk Python loop and the conv unfused: "
                  "several times slower per Gated DeltaNet layer on long sequences"),
    "causal_conv1d": Kernel("causal-conv1d", "causal_conv1d",
                            "transformers' own Gated DeltaNet conv (stock forwards, e.g. hf rollout generation)",
                            "transformers falls back to an unfused torch conv (slower decoding)"),
    "flash_attn": Kernel("flash-attn", "flash_attn",
                         "varlen causal attention over packed sequences",
                         "packed attention is re-padded to the longest sequence and run through SDPA: "
                         "compute and memory grow with the padding removed elsewhere"),
}

_warned: set[str] = set()
_reported: set[tuple] = set()


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def needed_kernels(spec, use_remove_padding: bool) -> list[str]:
    """Kernel names that speed up ``spec``'s model as configured."""
    names = []
    if getattr(spec, "has_linear_attention", False):
        names += ["fla", "causal_conv1d"]
    if use_remove_padding:
        names.append("flash_attn")
    return names


def report_kernels(spec, use_remove_padding: bool, on_cuda: Optional[bool] = None, rank0: bool = True) -> dict[str, bool]:
    """``{kernel: available}`` for the kernels ``spec`` needs. On CUDA, a missing one logs a one-time
    warning naming the package and the cost; rank 0 prints the summary line (the run's first log lines)."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    status = {name: importable(KERNELS[name].module) for name in needed_kernels(spec, use_remove_padding)}
    if on_cuda:
        for name, ok in status.items():
            if not ok and name not in _warned:
                _warned.add(name)
                k = KERNELS[name]
                logger.warning("fast kernel missing: `pip install %s` for %s; without it %s", k.package, k.used_for,
                               k.fallback_cost)
    key = (getattr(spec, "architecture", None), tuple(status.items()), on_cuda)
    if rank0 and status and key not in _reported:
        _reported.add(key)
        where = "cuda" if on_cuda else "cpu (kernels unused: torch reference paths)"
        summary = ", ".join(f"{KERNELS[n].package}={'yes' if ok else 'no'}" for n, ok in status.items())
        message = f"[verl.kernels] {getattr(spec, 'architecture', 'model')} on {where}: {summary}"
        logger.info(message)
        print(message, flush=True)
    return status
