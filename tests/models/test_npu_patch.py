"""NPU patch wiring, with a fake torch_npu that records calls and computes the reference maths."""

import sys
import types
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from qwen35_test_utils import packed_positions, patched_copy, random_ids
from verl.models.qwen3_5 import npu_patch


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _fake_torch_npu(calls: Counter):
    fake = types.ModuleType("torch_npu")

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls["npu_rms_norm"] += 1
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        return x * rstd * gamma, rstd

    def npu_swiglu(x, dim=-1):
        calls["npu_swiglu"] += 1
        a, b = x.chunk(2, dim=dim)
        return F.silu(a) * b

    def npu_rotary_mul(x, r1, r2):
        calls["npu_rotary_mul"] += 1
        return x * r1 + _rotate_half(x) * r2

    def npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type, **unused):
        calls[f"npu_grouped_matmul[type={group_type}]"] += 1
        assert group_list_type == 0 and len(x) == 1 and len(weight) == 1
        ends = group_list.tolist()
        starts = [0] + ends[:-1]
        x, w = x[0], weight[0]
        if group_type == 0:  # rows of x split into groups, one weight matrix per group
            return [torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends))], dim=0)]
        assert group_type == 2  # reduced axis split: one output matrix per group
        return [torch.stack([x[:, s:e] @ w[s:e] for s, e in zip(starts, ends)])]

    for fn in (npu_rms_norm, npu_swiglu, npu_rotary_mul, npu_grouped_matmul):
        setattr(fake, fn.__name__, fn)
    return fake


@pytest.fixture
def fake_npu(monkeypatch):
    """Returns an installer: call it only once models are built and run, because libraries probe for
    torch_npu while lazily importing (transformers/accelerate) and would take the fake for a real install."""
    calls = Counter()

    def install():
        monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
        return calls

    yield install
    npu_patch.revert_npu_patches()


def test_no_patches_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert npu_patch.apply_npu_patches() == []


def _run(model, ids, pos):
    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    (logits.float().log_softmax(-1)[..., 5] * torch.linspace(-1, 1, ids.shape[1])[None]).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_npu_patches_same_numbers(tiny_models, fake_npu, kind):
    model = patched_copy(tiny_models(kind))  # NPU ops compose with the packed forwards
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 9]
    ids = torch.cat([random_ids(n, gen) for n in lengths], 1)
    pos = packed_positions(lengths)
    ref_logits, ref_grads = _run(model, ids, pos)
    calls = fake_npu()

    names = npu_patch.apply_npu_patches(force=True)
    assert "Qwen3_5RMSNorm.forward" in names and "Qwen3_5MoeExperts.forward" in names
    assert npu_patch.apply_npu_patches(force=True) == names  # idempotent
    logits, grads = _run(model, ids, pos)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")

    assert calls["npu_rms_norm"] > 0 and calls["npu_swiglu"] > 0 and calls["npu_rotary_mul"] == 2
    if kind == "moe":
        # Per MoE layer: 2 row-grouped matmuls forward, 2 more (dx) and 2 reduced-axis ones (dw) backward.
        n_layers = model.config.num_hidden_layers
        assert calls["npu_grouped_matmul[type=0]"] == 4 * n_layers
        assert calls["npu_grouped_matmul[type=2]"] == 2 * n_layers
    else:
        assert not any(k.startswith("npu_grouped_matmul") for k in calls)

    npu_patch.revert_npu_patches()
    calls.clear()
    again, _ = _run(model, ids, pos)
    assert not calls
    torch.testing.assert_close(again, ref_logits, atol=1e-6, rtol=0)
