"""Which kernels a model runs with, said once at start-up, and a warning for each slow fallback on CUDA.

The Qwen3.5 forwards fall back to exact torch code when a kernel package is absent (that is what the CPU CI
runs), so a missing package never fails a run; on a GPU it costs time, which users must hear about rather
than discover (a silent torch fallback of the Gated DeltaNet delta rule has cost users 2x elsewhere).

What is reported is what the code will run, asked of the code that chooses: a model's own parts from the
function its spec names (``ModelSpec.kernels``: Qwen3.5's Gated DeltaNet backend, where an installed fla that
fails to import counts as absent, as it runs), packed attention from ``packed_attention.select_backend`` (flash-attn, else torch's own varlen attention, else padded
SDPA: only the last is slow). A backend forced through an environment variable is reported, never warned about.

The model spec says what a model needs (``kernels``, ``native_packing``); ``engine`` says which
forwards run: ``fsdp`` (the patched HF model, and the stock HF forwards of hf-rollout generation) or ``mcore``
(the Megatron model of :mod:`verl.models.mcore`, whose packed attention is always SDPA per sequence).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
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
                            "transformers' own Gated DeltaNet conv (padded forwards: use_remove_padding=false)",
                            "transformers falls back to an unfused torch conv (slower decoding)"),
    "flash_attn": Kernel("flash-attn", "flash_attn",
                         "varlen causal attention over packed sequences",
                         "neither flash-attn nor torch's varlen attention (torch >= 2.10) is available, so packed "
                         "attention is re-padded to the longest sequence and run through SDPA: compute and memory "
                         "grow with the padding removed elsewhere"),
}


@dataclass(frozen=True)
class KernelChoice:
    """What one part of the model runs on: ``backend`` as the summary line says it, ``slow`` when that is a
    fallback a missing ``kernel`` (a key of :data:`KERNELS`) causes."""

    backend: str
    slow: bool = False
    kernel: Optional[str] = None


_warned: set[str] = set()
_reported: set[tuple] = set()


@functools.lru_cache(maxsize=None)
def importable(module: str) -> bool:
    """Whether the code that uses ``module`` gets it: the import the code does, not a look-up of installed files
    (a package built for another torch or CUDA is installed yet fails to import, and the code then falls back)."""
    if module == "flash_attn":
        from verl.models.transformers.packed_attention import _flash_varlen

        return _flash_varlen() is not None
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or whatever a broken build raises at import
        return False
    return True


def _packed_attention_choice(spec, on_cuda: bool) -> KernelChoice:
    if not getattr(spec, "native_packing", False):
        # Other models pack through transformers' flash_attention_2 (the spec allows packing only then).
        return KernelChoice("flash-attn (transformers flash_attention_2)")
    from verl.models.transformers.packed_attention import BACKEND_ENV, forced_backend, select_backend

    if forced_backend() is not None:
        return KernelChoice(f"{forced_backend()} ({BACKEND_ENV})")
    backend = select_backend(fast=on_cuda)
    return KernelChoice(backend, slow=on_cuda and backend == "sdpa", kernel="flash_attn")


def kernel_choices(spec, use_remove_padding: bool, on_cuda: bool, engine: str = "fsdp") -> dict[str, KernelChoice]:
    """``{part: KernelChoice}`` for the parts of ``spec``'s model that have a fast kernel, as ``engine`` runs it."""
    if engine not in ("fsdp", "mcore"):
        raise ValueError(f"engine must be 'fsdp' or 'mcore', got {engine!r}")
    # The model's own parts first (``ModelSpec.kernels``, e.g. Qwen3.5's Gated DeltaNet), then packed attention.
    own = spec.resolve("kernels") if hasattr(spec, "resolve") else None
    choices = dict(own(on_cuda, engine, use_remove_padding)) if own is not None else {}
    if engine == "mcore":
        from verl.models.transformers.packed_attention import select_backend

        backend = select_backend(fast=on_cuda)  # the local spec's packed attention asks the same (bf16/fp16)
        choices["packed_attention"] = KernelChoice(
            f"{backend} (local spec)" if backend != "sdpa" else "sdpa per sequence (local spec)")
    elif use_remove_padding:
        choices["packed_attention"] = _packed_attention_choice(spec, on_cuda)
    return choices


def report_kernels(spec, use_remove_padding: bool, on_cuda: Optional[bool] = None, rank0: bool = True,
                   engine: str = "fsdp") -> dict[str, KernelChoice]:
    """Say which kernels ``spec``'s model runs with. On CUDA, each slow fallback logs a one-time warning naming
    the package to install and the cost; rank 0 prints the summary line (among the run's first log lines)."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    choices = kernel_choices(spec, use_remove_padding, on_cuda, engine)
    for choice in choices.values():
        if choice.slow and choice.kernel not in _warned:
            _warned.add(choice.kernel)
            k = KERNELS[choice.kernel]
            logger.warning("fast kernel missing: `pip install %s` for %s; without it %s", k.package, k.used_for,
                           k.fallback_cost)
    key = (getattr(spec, "architecture", None), engine, tuple(choices.items()), on_cuda)
    if rank0 and choices and key not in _reported:
        _reported.add(key)
        where = "cuda" if on_cuda else "cpu (torch reference paths)"
        summary = ", ".join(f"{part}={c.backend}" for part, c in choices.items())
        message = f"[verl.kernels] {getattr(spec, 'architecture', 'model')} ({engine}) on {where}: {summary}"
        logger.info(message)
        print(message, flush=True)
    return choices
