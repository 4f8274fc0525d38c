"""Memory-lean log-prob + entropy of ``softmax(hidden @ weight.T / T)`` at the label.

The language-model head of Qwen3.5 has a 248,320-entry vocabulary, so materialising the
``(tokens, vocab)`` logits of a PPO micro-batch (plus the fp32 copies that ``log_softmax``
and the entropy need) dominates actor memory. :func:`linear_log_prob_entropy` instead walks
over token chunks:

* forward: per chunk, ``z = h_c @ W.T / T`` in fp32, then keep only the per-token
  ``logsumexp`` and entropy (two floats per token) and the label log-prob;
* backward: per chunk, recompute ``z``, form ``dL/dz`` in fp32, and push it through the two
  matmuls. ``dL/dW`` is accumulated in an fp32 buffer across chunks.

Gradient of the two outputs w.r.t. the scaled logits ``z`` (``p = softmax(z)``,
``lse = logsumexp(z)``, ``H = lse - sum(p * z)``)::

    d logp / dz_j = onehot_j - p_j
    d H    / dz_j = -p_j * (z_j - lse + H)

so ``dz = g_lp * onehot - p * (g_lp + g_ent * (z - lse + H))`` and the raw logits get ``dz / T``.

``backend="triton"`` dispatches to :mod:`verl.utils.kernel.triton_linear_logprob` (CUDA only).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from verl.utils.kernel.matmul import accumulate_mm

__all__ = [
    "FusedLinearForPPO",
    "LinearLogProbEntropy",
    "auto_chunk_size",
    "linear_log_prob_entropy",
    "reference_log_prob_entropy",
]

# Budget for one chunk of fp32 logits; the backward holds ~2-3 such buffers at once.
_CHUNK_BYTES = 1 << 30
_BACKENDS = ("torch", "triton")


def auto_chunk_size(vocab_size: int, budget_bytes: int = _CHUNK_BYTES) -> int:
    """Tokens per chunk so that one fp32 ``(chunk, vocab)`` logits block fits ``budget_bytes``.

    Rounded down to a multiple of 64 (tensor-core friendly), at least 64.
    """
    tokens = budget_bytes // (4 * max(int(vocab_size), 1))
    return max(64, (tokens // 64) * 64)


# ----------------------------------------------------------------------------- matmul helpers


def _logits_fp32(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T`` as an fp32 tensor, accumulating in fp32 for half inputs.

    On CUDA the ``out_dtype`` overload of ``mm`` keeps the fp32 accumulator instead of rounding
    the logits to bf16; elsewhere half inputs are upcast chunk-wise (the chunk is small).
    """
    if h.dtype == torch.float32:
        return h @ weight.t()
    if h.is_cuda:
        try:
            return torch.mm(h, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # older torch without the dtype overload
            pass
    return h.float() @ weight.float().t()


def _chunk_stats(z: torch.Tensor, labels: torch.Tensor):
    """``(lse, entropy, label_logit)`` of fp32 logits ``z`` (n, V). Overwrites ``z``."""
    label_logit = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.sub_(lse.unsqueeze(-1))
    p = torch.exp(logp)
    # H = -sum_j p_j log p_j as a batched dot product (no extra (n, V) temporary). Summing
    # p * log p rather than computing lse - sum(p * z) avoids cancelling two large numbers; the
    # backward's error is proportional to this one's.
    entropy = torch.bmm(p.unsqueeze(1), logp.unsqueeze(2)).view(-1).neg_()
    return lse, entropy, label_logit


# ----------------------------------------------------------------------------- autograd function


class LinearLogProbEntropy(torch.autograd.Function):
    """Token-chunked ``(log_probs, entropy)`` of a linear LM head. See module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size):
        n_tok = hidden.shape[0]
        inv_t = 1.0 / float(temperature)
        log_probs = torch.empty(n_tok, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(log_probs)
        lse = torch.empty_like(log_probs)
        for s in range(0, n_tok, chunk_size):
            e = min(s + chunk_size, n_tok)
            z = _logits_fp32(hidden[s:e], weight)
            if inv_t != 1.0:
                z.mul_(inv_t)
            c_lse, c_ent, c_lab = _chunk_stats(z, labels[s:e])
            del z
            lse[s:e] = c_lse
            entropy[s:e] = c_ent
            log_probs[s:e] = c_lab - c_lse
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.inv_t = inv_t
        ctx.chunk_size = chunk_size
        return log_probs, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None
        n_tok = hidden.shape[0]
        zeros = None
        if g_lp is None or g_ent is None:
            zeros = torch.zeros(n_tok, dtype=torch.float32, device=hidden.device)
        g_lp = zeros if g_lp is None else g_lp.float()
        g_ent = zeros if g_ent is None else g_ent.float()
        inv_t = ctx.inv_t
        cdtype = hidden.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, n_tok, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n_tok)
            h_c = hidden[s:e]
            z = _logits_fp32(h_c, weight)
            if inv_t != 1.0:
                z.mul_(inv_t)
            c_lse, c_ent, c_glp, c_gent = lse[s:e, None], entropy[s:e, None], g_lp[s:e], g_ent[s:e]
            z.sub_(c_lse)  # z <- log p (subtract first: keeps the fp32 error at the fp32-autograd level)
            p = torch.exp(z)
            # z <- -p * (g_lp + g_ent * (log p + H)), in place.
            z.add_(c_ent).mul_(c_gent.unsqueeze(-1)).add_(c_glp.unsqueeze(-1)).mul_(p).neg_()
            del p
            z.scatter_add_(-1, labels[s:e].unsqueeze(-1), c_glp.unsqueeze(-1))
            if inv_t != 1.0:
                z.mul_(inv_t)
            dz = z if cdtype == torch.float32 else z.to(cdtype)
            del z
            if need_h:
                grad_h[s:e] = dz @ weight
            if need_w:
                accumulate_mm(grad_w, dz.t(), h_c)
            del dz
        if need_w and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


# ----------------------------------------------------------------------------- public API


def _flatten(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != hidden leading shape {tuple(hidden.shape[:-1])}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if weight.dtype != h2.dtype:  # compute in the wider of the two dtypes
        common = torch.promote_types(h2.dtype, weight.dtype)
        h2, weight = h2.to(common), weight.to(common)
    return h2, weight, labels.reshape(-1).long()


def linear_log_prob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log softmax(hidden @ weight.T / temperature)[label]`` and softmax entropy.

    Args:
        hidden: ``(N, H)`` (or ``(..., H)``) activations before the LM head.
        weight: ``(V, H)`` LM-head weight.
        labels: ``(N,)`` (or ``(...)``) token ids in ``[0, V)``.
        temperature: logits are divided by it (must be > 0).
        chunk_size: tokens per chunk; ``None`` picks :func:`auto_chunk_size` (~1 GiB fp32 logits
            per chunk, 1024 tokens at V=248,320).
        backend: ``"torch"`` (any device) or ``"triton"`` (CUDA; needs triton).

    Returns:
        ``(log_probs, entropy)``, both fp32 with the shape of ``labels``. The full ``(N, V)``
        logits are never materialised, in forward or backward.
    """
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite positive number, got {temperature}")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {_BACKENDS}")
    out_shape = labels.shape
    h2, w, lab = _flatten(hidden, weight, labels)
    if chunk_size is None:
        chunk_size = auto_chunk_size(w.shape[0])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "linear_log_prob_entropy(backend='triton') needs triton, which is not installed; "
                "install the `gpu` extra (pip install -e '.[gpu]') on a CUDA machine or use backend='torch'"
            ) from exc
        from verl.utils.kernel.triton_linear_logprob import triton_linear_log_prob_entropy

        lp, ent = triton_linear_log_prob_entropy(h2, w, lab, temperature=temperature, chunk_size=chunk_size)
    else:
        lp, ent = LinearLogProbEntropy.apply(h2, w, lab, float(temperature), int(chunk_size))
    return lp.view(out_shape), ent.view(out_shape)


def reference_log_prob_entropy(hidden, weight, labels, temperature: float = 1.0):
    """Materialised-logits reference (what the fused op replaces): full fp32 ``(N, V)`` logits."""
    logits = hidden.float() @ weight.float().t() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    log_probs = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return log_probs, entropy


class FusedLinearForPPO(torch.nn.Module):
    """Module form, call-compatible with upstream's ``FusedLinearForPPO``.

    ``forward(hidden_states, vocab_weights, input_ids, temperature=1.0) -> (log_probs, entropy)``
    where ``input_ids`` are the labels (next tokens). ``impl_backend`` is ``"torch"`` or
    ``"triton"``.
    """

    def __init__(self, chunk_size: Optional[int] = None, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in _BACKENDS:
            raise ValueError(f"unsupported FusedLinearForPPO backend {impl_backend!r}; choose one of {_BACKENDS}")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        return linear_log_prob_entropy(
            hidden_states,
            vocab_weights,
            input_ids,
            temperature=temperature,
            chunk_size=self.chunk_size,
            backend=self.impl_backend,
        )
