"""Upstream's ``model.lora.lora_A_init_method`` / ``lora_B_init_method``: how a fresh LoRA adapter starts.

PEFT initialises A kaiming-uniform and B to zero. Upstream's Megatron LoRA defaults A to xavier; here the keys
choose, with null keeping PEFT's init. B must start at zero (the only value allowed): with a non-zero B the
adapted model would not start as the base model. An adapter loaded from ``adapter_path`` keeps its weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from verl.utils.config import cfg_get

__all__ = ["LORA_A_INITS", "LORA_B_INITS", "init_fresh_adapter"]


def _xavier(weight: torch.Tensor) -> None:
    nn.init.xavier_uniform_(weight)


def _kaiming(weight: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's own init, which PEFT uses for A


LORA_A_INITS = {"xavier": _xavier, "kaiming": _kaiming}
LORA_B_INITS = {"zero": nn.init.zeros_}


def _adapter_weights(model: nn.Module, which: str):
    """The ``lora_A`` / ``lora_B`` weights of every adapted module (Linear adapters and fused-expert ones)."""
    for name, param in model.named_parameters():
        if f".{which}." in f".{name}." and param.requires_grad:
            yield name, param


@torch.no_grad()
def init_fresh_adapter(model: nn.Module, lora_section: Any) -> None:
    """Re-initialise a freshly made adapter's A and B as the section's init keys say (nothing set: no change)."""
    for which, key, table in (("lora_A", "lora_A_init_method", LORA_A_INITS),
                              ("lora_B", "lora_B_init_method", LORA_B_INITS)):
        method = cfg_get(lora_section, key, None) if lora_section is not None else None
        if method is None:
            continue
        if method not in table:  # validation names the key first; a direct caller gets the same words
            raise ValueError(f"model.lora.{key}={method!r}; choose one of {sorted(table)} or null")
        for _, weight in _adapter_weights(model, which):
            table[method](weight)
