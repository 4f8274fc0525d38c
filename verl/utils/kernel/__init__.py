"""Fused kernels. Triton code lives in submodules that are imported lazily (CUDA only)."""

from verl.utils.kernel.linear_logprob import (
    FusedLinearForPPO,
    LinearLogProbEntropy,
    auto_chunk_size,
    linear_log_prob_entropy,
    reference_log_prob_entropy,
)

__all__ = [
    "FusedLinearForPPO",
    "LinearLogProbEntropy",
    "auto_chunk_size",
    "linear_log_prob_entropy",
    "reference_log_prob_entropy",
]
