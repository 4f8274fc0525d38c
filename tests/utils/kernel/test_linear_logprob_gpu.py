"""GPU tests: torch and triton backends of linear_log_prob_entropy vs materialised logits.

Run on a CUDA machine with ``pytest -m gpu tests/utils/kernel/test_linear_logprob_gpu.py``.
"""

import importlib.util

import pytest
import torch

from verl.utils.kernel import linear_log_prob_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])


def _inputs(n, h, v, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 3 / h**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    return hidden, weight, labels, g_lp, g_ent


def _reference(hidden, weight, labels, temperature, g_lp, g_ent):
    """fp64 materialised logits on the same (possibly bf16-rounded) inputs."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    lsm = torch.log_softmax(h @ w.t() / temperature, dim=-1)
    lp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize(
    "n,h,v,temperature",
    [(300, 128, 1000, 1.0), (517, 256, 3001, 0.7), (64, 64, 248_320, 1.3)],  # odd sizes, real vocab
)
def test_bf16_fwd_bwd_matches_reference(backend, n, h, v, temperature):
    hidden, weight, labels, g_lp, g_ent = _inputs(n, h, v, torch.bfloat16)
    lp, ent = linear_log_prob_entropy(hidden, weight, labels, temperature=temperature, chunk_size=128,
                                      backend=backend)
    (lp * g_lp + ent * g_ent).sum().backward()
    r_lp, r_ent, r_gh, r_gw = _reference(hidden, weight, labels, temperature, g_lp, g_ent)
    # Values: fp32 accumulation of bf16 products, so well inside bf16 resolution.
    torch.testing.assert_close(lp.double(), r_lp, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(ent.double(), r_ent, atol=2e-3, rtol=2e-3)
    # Grads are rounded to bf16 (rel. 2^-8) and dlogits goes through a bf16 matmul.
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert _rel_err(hidden.grad, r_gh) < 1e-2
    assert _rel_err(weight.grad, r_gw) < 1e-2


@pytest.mark.parametrize("backend", _BACKENDS)
def test_fp32_matches_reference_tightly(backend):
    hidden, weight, labels, g_lp, g_ent = _inputs(200, 64, 777, torch.float32, seed=1)
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch backend's fp32 matmuls must be exact
    lp, ent = linear_log_prob_entropy(hidden, weight, labels, temperature=0.9, chunk_size=64, backend=backend)
    (lp * g_lp + ent * g_ent).sum().backward()
    r_lp, r_ent, r_gh, r_gw = _reference(hidden, weight, labels, 0.9, g_lp, g_ent)
    tol = dict(atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(lp.double(), r_lp, **tol)
    torch.testing.assert_close(ent.double(), r_ent, **tol)
    torch.testing.assert_close(hidden.grad.double(), r_gh, **tol)
    torch.testing.assert_close(weight.grad.double(), r_gw, **tol)


@pytest.mark.skipif("triton" not in _BACKENDS, reason="needs triton")
def test_triton_agrees_with_torch_backend_and_saves_memory():
    n, h, v = 2048, 256, 248_320
    hidden, weight, labels, g_lp, g_ent = _inputs(n, h, v, torch.bfloat16, seed=2)
    out = {}
    for backend in ("torch", "triton"):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lp, ent = linear_log_prob_entropy(hidden, weight, labels, chunk_size=256, backend=backend)
        (lp * g_lp + ent * g_ent).sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        out[backend] = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone(), peak)
    a, b = out["torch"], out["triton"]
    torch.testing.assert_close(a[0], b[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(a[1], b[1], atol=2e-3, rtol=2e-3)
    assert _rel_err(b[2], a[2].double()) < 1e-2
    assert _rel_err(b[3], a[3].double()) < 1e-2
    # Materialising needs >= n * v * (2 + 4) bytes (bf16 logits + fp32 log-softmax); the fused
    # path stays below the bf16 logits alone (its floor is the fp32 dW buffer + one dlogits chunk).
    for backend in ("torch", "triton"):
        assert out[backend][4] < n * v * 2, f"{backend} peak {out[backend][4] / 2**20:.0f} MiB"
