"""Read the logits off a model's forward output, whatever shape the model returns it in."""

from __future__ import annotations

import torch


def get_logits(out) -> torch.Tensor:
    """``out.logits`` for HF ``ModelOutput``s, ``out[0]`` for models returning a tuple ``(logits, ...)``
    (``return_dict=False`` or custom models), ``out`` itself for a bare tensor."""
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    elif logits is None and isinstance(out, torch.Tensor):
        logits = out
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cannot find logits in a model output of type {type(out).__name__}: expected an object "
                        "with .logits, a tuple whose first item is the logits tensor, or a tensor")
    return logits
