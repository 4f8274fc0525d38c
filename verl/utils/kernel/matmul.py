"""fp32-accumulating matmul shared by the log-prob kernels (torch and Triton backends)."""

from __future__ import annotations

import torch

__all__ = ["accumulate_mm"]


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``/``b`` possibly bf16/fp16."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if acc.is_cuda:
        try:
            # In-place, fp32 output from half inputs: no (V, H) temporary.
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):  # no dtype_out overload: fp32 temporary instead
            pass
        try:
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))
        except (RuntimeError, TypeError):
            acc.add_((a @ b).float())
        return
    acc.addmm_(a.float(), b.float())
