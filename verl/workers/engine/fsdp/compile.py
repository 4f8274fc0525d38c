"""``use_torch_compile``: upstream compiles the entropy-from-logits helper (dynamic shapes).

Inductor compiles C++/Triton code on first use; on an accelerator that pays back within a few steps. On a
CPU-only host (this project's CI and demo) the compile takes longer than the whole run saves, so the key is
applied on accelerators only and the CPU run says so once in the log."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from verl.utils.device import get_device_name

logger = logging.getLogger(__name__)
_cpu_noted = False


def maybe_compile(fn: Callable, backend: str | None = None) -> Callable:
    """``torch.compile(fn, dynamic=True)`` on an accelerator (or with an explicit ``backend``); ``fn`` on CPU."""
    global _cpu_noted
    if backend is None and get_device_name() == "cpu":
        if not _cpu_noted:
            logger.info("use_torch_compile: not compiling on CPU (inductor's compile time exceeds the gain); "
                        "the entropy helper runs eagerly")
            _cpu_noted = True
        return fn
    compiled = torch.compile(fn, dynamic=True, **({"backend": backend} if backend else {}))
    compiled._verl_compiled = True
    return compiled
