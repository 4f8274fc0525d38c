"""Layer-level checks: boundary-aware conv, chunked delta rule, and packed-then-sliced == standalone layers."""

import pytest
import torch
import torch.nn.functional as F

from qwen35_test_utils import patched_copy
from verl.models.qwen3_5.gated_deltanet import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
    torch_causal_conv1d,
)
from verl.models.transformers.packed_attention import PackedSeqInfo, cu_seqlens_from_starts

LENGTHS = [3, 9, 1, 20]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_conv_restarts_at_boundaries():
    gen = torch.Generator().manual_seed(0)
    channels, width = 6, 4
    x = torch.randn(1, sum(LENGTHS), channels, generator=gen)
    w = torch.randn(channels, width, generator=gen)
    got = torch_causal_conv1d(x, w, None, _cu(LENGTHS), "silu")
    start = 0
    for n in LENGTHS:
        seg = x[:, start : start + n].transpose(1, 2)
        ref = F.silu(F.conv1d(seg, w[:, None, :], padding=width - 1, groups=channels)[..., :n]).transpose(1, 2)
        torch.testing.assert_close(got[:, start : start + n], ref, atol=1e-6, rtol=0)
        start += n
    # Without boundaries the second sequence sees the first one's tail: the masking is what makes it exact.
    leaky = torch_causal_conv1d(x, w, None, None, "silu")
    assert (leaky[:, 3:6] - got[:, 3:6]).abs().max() > 1e-4


@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_chunked_delta_rule_matches_recurrence(chunk):
    gen = torch.Generator().manual_seed(1)
    b, t, h, dk, dv = 2, 21, 3, 8, 5
    q, k = (l2_normalize(torch.randn(b, t, h, dk, generator=gen)) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 2
    beta = torch.rand(b, t, h, generator=gen)
    ref, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta)
    got, state = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_packed_delta_rule_restarts_state():
    gen = torch.Generator().manual_seed(2)
    t, h, dk, dv = sum(LENGTHS), 2, 8, 4
    q, k = (torch.randn(1, t, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(1, t, h, dv, generator=gen)
    g = -torch.rand(1, t, h, generator=gen)
    beta = torch.rand(1, t, h, generator=gen)
    got = gated_delta_rule(q, k, v, g, beta, cu_seqlens=_cu(LENGTHS))
    start = 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        ref, _ = recurrent_gated_delta_rule(
            l2_normalize(q[:, sl]), l2_normalize(k[:, sl]), v[:, sl], g[:, sl], beta[:, sl]
        )
        torch.testing.assert_close(got[:, sl], ref, atol=1e-5, rtol=1e-5)
        start += n


def test_cu_seqlens_from_starts():
    starts = torch.tensor([1, 0, 0, 1, 1, 0], dtype=torch.bool)
    cu, max_len = cu_seqlens_from_starts(starts)
    assert cu.tolist() == [0, 3, 4, 6] and max_len == 3 and cu.dtype == torch.int32


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_then_sliced_equals_standalone_layers(tiny_models, kind):
    model = tiny_models(kind)
    patched = patched_copy(model)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, sum(LENGTHS), model.config.hidden_size, generator=gen)
    info = PackedSeqInfo(_cu(LENGTHS), max(LENGTHS))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    rope = patched.model.rotary_emb(hidden, pos[None].expand(3, -1, -1))

    gdn_idx = model.config.layer_types.index("linear_attention")
    attn_idx = model.config.layer_types.index("full_attention")
    gdn_out = patched.model.layers[gdn_idx].linear_attn(hidden, packed=info)
    attn_out, _ = patched.model.layers[attn_idx].self_attn(hidden, position_embeddings=rope, packed=info)
    start = 0
    for n in LENGTHS:
        seg = hidden[:, start : start + n]
        ref_gdn = model.model.layers[gdn_idx].linear_attn(seg)
        seg_rope = model.model.rotary_emb(seg, torch.arange(n)[None, None].expand(3, 1, n))
        ref_attn, _ = model.model.layers[attn_idx].self_attn(seg, position_embeddings=seg_rope, attention_mask=None)
        torch.testing.assert_close(gdn_out[:, start : start + n], ref_gdn, atol=1e-5, rtol=0)
        torch.testing.assert_close(attn_out[:, start : start + n], ref_attn, atol=1e-5, rtol=0)
        start += n
