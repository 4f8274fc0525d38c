"""GPU checks for the fla / flash-attn paths (run on a CUDA machine with fla installed: pytest -m gpu)."""

import pytest
import torch

from qwen35_test_utils import packed_positions, patched_copy, random_ids, token_log_probs
from verl.models.qwen3_5 import gated_deltanet as gdn

pytestmark = pytest.mark.gpu

needs_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or gdn._fla_functions() is None, reason="needs CUDA and flash-linear-attention"
)
LENGTHS = [5, 1, 130, 64, 17]


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _torch_only(monkeypatch):
    monkeypatch.setenv(gdn.GDN_BACKEND_ENV, "torch")


@needs_fla
def test_fla_conv_matches_torch(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, sum(LENGTHS), 96, device="cuda", generator=gen)
    w = torch.randn(96, 4, device="cuda", generator=gen)
    cu = _cu(LENGTHS, "cuda")
    assert gdn.use_fla(x.device)
    got = gdn.causal_conv1d(x, w, None, cu, "silu")
    _torch_only(monkeypatch)
    ref = gdn.causal_conv1d(x, w, None, cu, "silu")
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@needs_fla
def test_fla_delta_rule_matches_torch(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(1)
    t, h, dk, dv = sum(LENGTHS), 4, 32, 32
    q, k = (torch.randn(1, t, h, dk, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(1, t, h, dv, device="cuda", generator=gen)
    g = -torch.rand(1, t, h, device="cuda", generator=gen)
    beta = torch.rand(1, t, h, device="cuda", generator=gen)
    cu = _cu(LENGTHS, "cuda")
    got = gdn.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    _torch_only(monkeypatch)
    ref = gdn.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


@needs_fla
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_bf16_model_matches_per_sequence(tiny_models, kind):
    model = tiny_models(kind).to("cuda", torch.bfloat16)
    try:
        gen = torch.Generator().manual_seed(2)
        seqs = [random_ids(n, gen).cuda() for n in LENGTHS if n > 1]
        lengths = [s.shape[1] for s in seqs]
        patched = patched_copy(model)
        ids = torch.cat(seqs, 1)
        out = patched(input_ids=ids, position_ids=packed_positions(lengths).cuda(), use_cache=False).logits
        start = 0
        for s, n in zip(seqs, lengths):
            ref = token_log_probs(model(input_ids=s).logits, s)
            got = token_log_probs(out[:, start : start + n], s)
            torch.testing.assert_close(got, ref, atol=5e-2, rtol=0)
            start += n
    finally:
        model.to("cpu", torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_fallback_on_cuda_fp32(tiny_models, monkeypatch):
    """The pure-torch path on GPU (fla absent or disabled) matches the stock model in fp32."""
    _torch_only(monkeypatch)
    model = tiny_models("dense").cuda()
    try:
        gen = torch.Generator().manual_seed(3)
        seqs = [random_ids(n, gen).cuda() for n in (7, 70)]
        patched = patched_copy(model)
        out = patched(input_ids=torch.cat(seqs, 1), position_ids=packed_positions([7, 70]).cuda()).logits
        # cuDNN runs the fp32 conv in TF32 by default, hence a looser bound than on CPU.
        torch.testing.assert_close(out[:, 7:], model(input_ids=seqs[1]).logits, atol=5e-4, rtol=0)
    finally:
        model.cpu()
