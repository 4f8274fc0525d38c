"""CPU tests of the token-chunked linear log-prob / entropy op (torch backend)."""

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verl.utils.kernel import (
    FusedLinearForPPO,
    auto_chunk_size,
    linear_log_prob_entropy,
    reference_log_prob_entropy,
)


def _fp64_reference(hidden, weight, labels, temperature, g_lp, g_ent):
    """Materialised logits in fp64: the ground truth for values and (hidden, weight) grads."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.t() / temperature
    lsm = torch.log_softmax(logits, dim=-1)
    lp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp, ent, h.grad, w.grad


def _inputs(n, h, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    # Scale like a trained LM head (logits of order a few units), keeping softmax non-degenerate.
    weight = (torch.randn(v, h, generator=g, dtype=dtype) / h**0.5 * 3).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    g_lp = torch.randn(n, generator=g)
    g_ent = torch.randn(n, generator=g)
    return hidden, weight, labels, g_lp, g_ent


@pytest.mark.parametrize(
    "n,h,v,chunk,temperature,seed",
    [
        (37, 16, 50, 8, 0.7, 0),  # N not divisible by chunk, T < 1
        (64, 24, 97, 64, 1.0, 1),  # single exact chunk
        (29, 8, 131, 5, 1.6, 2),  # many chunks, T > 1, odd vocab
        (3, 32, 40, 100, 1.0, 3),  # chunk larger than N
    ],
)
def test_matches_materialised_reference(n, h, v, chunk, temperature, seed):
    hidden, weight, labels, g_lp, g_ent = _inputs(n, h, v, seed)
    lp, ent = linear_log_prob_entropy(hidden, weight, labels, temperature=temperature, chunk_size=chunk)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (n,)
    # Both outputs enter the loss so both backward paths (grad_log_probs, grad_entropy) are used.
    (lp * g_lp + ent * g_ent).sum().backward()
    r_lp, r_ent, r_gh, r_gw = _fp64_reference(hidden, weight, labels, temperature, g_lp, g_ent)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp.double(), r_lp.detach(), **tol)
    torch.testing.assert_close(ent.double(), r_ent.detach(), **tol)
    torch.testing.assert_close(hidden.grad.double(), r_gh, **tol)
    torch.testing.assert_close(weight.grad.double(), r_gw, **tol)


@pytest.mark.parametrize("which", ["log_probs", "entropy"])
def test_single_output_in_loss(which):
    # Only one output reaches the loss: autograd hands backward None for the other one.
    hidden, weight, labels, g_lp, g_ent = _inputs(21, 12, 33, 7)
    lp, ent = linear_log_prob_entropy(hidden, weight, labels, temperature=0.9, chunk_size=4)
    out, g = (lp, g_lp) if which == "log_probs" else (ent, g_ent)
    (out * g).sum().backward()
    zero = torch.zeros_like(g)
    r = _fp64_reference(hidden, weight, labels, 0.9, g if which == "log_probs" else zero,
                        g if which == "entropy" else zero)
    torch.testing.assert_close(hidden.grad.double(), r[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), r[3], atol=1e-5, rtol=1e-5)


def test_batched_shape_and_module_wrapper():
    hidden, weight, labels, _, _ = _inputs(12, 8, 20, 4)
    h3, l3 = hidden.detach().view(3, 4, 8), labels.view(3, 4)
    lp, ent = FusedLinearForPPO(chunk_size=5)(h3, weight.detach(), l3, temperature=1.3)
    assert lp.shape == (3, 4) and ent.shape == (3, 4)
    r_lp, r_ent = reference_log_prob_entropy(hidden.detach(), weight.detach(), labels, 1.3)
    torch.testing.assert_close(lp.view(-1), r_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.view(-1), r_ent, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    hidden, weight, labels, g_lp, g_ent = _inputs(40, 64, 70, 5)
    hb = hidden.detach().bfloat16().requires_grad_()
    wb = weight.detach().bfloat16().requires_grad_()
    lp, ent = linear_log_prob_entropy(hb, wb, labels, chunk_size=16)
    assert lp.dtype == torch.float32
    (lp * g_lp + ent * g_ent).sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    # Reference on the same bf16-rounded values, in fp64: only output rounding differs.
    r_lp, r_ent, r_gh, r_gw = _fp64_reference(hb.float(), wb.float(), labels, 1.0, g_lp, g_ent)
    torch.testing.assert_close(lp.double(), r_lp.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent.double(), r_ent.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hb.grad.double(), r_gh, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(wb.grad.double(), r_gw, atol=2e-2, rtol=1e-2)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor produced by any aten op."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_never_materialises_full_logits():
    n, h, v, chunk = 48, 8, 300, 16
    hidden, weight, labels, g_lp, g_ent = _inputs(n, h, v, 6)
    with _LargestTensor() as mode:
        lp, ent = linear_log_prob_entropy(hidden, weight, labels, chunk_size=chunk)
        (lp * g_lp + ent * g_ent).sum().backward()
    # Largest allowed: one chunk of logits (chunk * V) -- far below N * V.
    assert mode.max_numel <= chunk * v < n * v
    # The detector does fire on the materialised path, so the assertion above can fail.
    with _LargestTensor() as mode:
        reference_log_prob_entropy(hidden, weight, labels)
    assert mode.max_numel >= n * v


def test_saved_tensors_are_small():
    n, h, v = 40, 8, 256
    hidden, weight, labels, _, _ = _inputs(n, h, v, 8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        linear_log_prob_entropy(hidden, weight, labels, chunk_size=8)
    # Saved for backward: hidden, weight, labels and two (N,) fp32 stats; nothing of size N*V.
    assert saved and max(saved) < n * v
    assert sorted(saved) == sorted([n * h, v * h, n, n, n])


def test_auto_chunk_size_budget():
    c = auto_chunk_size(248_320)
    assert c % 64 == 0 and c * 248_320 * 4 <= 1 << 30 and (c + 64) * 248_320 * 4 > 1 << 30
    assert auto_chunk_size(10) >= 64


def test_argument_validation():
    hidden, weight, labels, _, _ = _inputs(4, 8, 10, 9)
    with pytest.raises(ValueError):
        linear_log_prob_entropy(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError):
        linear_log_prob_entropy(hidden, weight, labels, backend="cuda")
    with pytest.raises(ValueError):
        linear_log_prob_entropy(hidden, weight, labels[:3])


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton installed")
def test_triton_backend_without_triton_names_gpu_extra():
    hidden, weight, labels, _, _ = _inputs(4, 8, 10, 10)
    with pytest.raises(ImportError, match="gpu"):
        linear_log_prob_entropy(hidden, weight, labels, backend="triton")
