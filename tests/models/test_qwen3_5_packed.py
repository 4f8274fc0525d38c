"""Patched Qwen3.5 forwards vs the stock HF model run on each sequence alone (fp32, CPU)."""

import pytest
import torch

from qwen35_test_utils import (
    make_image_sample,
    packed_positions,
    patched_copy,
    random_ids,
    token_log_probs,
)

ATOL = 1e-5


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(ref, got, rtol=1e-4):
    assert ref, "reference produced no gradients"
    for name, g in ref.items():
        assert name in got, f"missing gradient for {name}"
        torch.testing.assert_close(got[name], g, atol=ATOL, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_packed_text_matches_per_sequence(tiny_models, kind):
    model = tiny_models(kind)
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 1, 5, 70]  # a 1-token sequence and one longer than a 64-token delta-rule chunk
    seqs = [random_ids(n, gen) for n in lengths]
    weights = [torch.randn(n - 1, generator=gen) for n in lengths]

    model.zero_grad()
    ref_lp = []
    for ids, w in zip(seqs, weights):
        lp = token_log_probs(model(input_ids=ids).logits, ids)[0]
        (lp * w).sum().backward()
        ref_lp.append(lp.detach())
    ref_grads = _grads(model)
    model.zero_grad()

    patched = patched_copy(model)
    ids = torch.cat(seqs, dim=1)
    out = patched(input_ids=ids, position_ids=packed_positions(lengths), attention_mask=None, use_cache=False)
    assert out.logits.shape == (1, sum(lengths), model.config.vocab_size)
    loss, start = 0.0, 0
    for n, ref, w in zip(lengths, ref_lp, weights):
        lp = token_log_probs(out.logits[:, start : start + n], ids[:, start : start + n])[0]
        torch.testing.assert_close(lp, ref, atol=ATOL, rtol=0)
        loss = loss + (lp * w).sum()
        start += n
    loss.backward()
    _assert_grads_close(ref_grads, _grads(patched))


def test_stock_model_leaks_across_packed_boundaries(tiny_models):
    """Guards the oracle: without the patch the GDN state crosses sequences, so the packed test is meaningful."""
    model = tiny_models("dense")
    gen = torch.Generator().manual_seed(2)
    a, b = random_ids(6, gen), random_ids(6, gen)
    ref_b = model(input_ids=b).logits
    packed = model(input_ids=torch.cat([a, b], 1), position_ids=packed_positions([6, 6])).logits
    assert (packed[0, 6:] - ref_b[0]).abs().max() > 1e-3


@pytest.mark.parametrize("rows", [4, 3])
def test_packed_vl_matches_per_sequence(tiny_models, rows):
    model = tiny_models("vl")
    gen = torch.Generator().manual_seed(3)
    samples = [make_image_sample(3, (1, 4, 4), 5, gen), make_image_sample(2, (1, 4, 8), 3, gen)]
    text_only = random_ids(9, gen)

    model.zero_grad()
    ref_lp, positions = [], []
    for s in samples:
        lp = token_log_probs(model(**s).logits, s["input_ids"])[0]
        lp.sum().backward()
        ref_lp.append(lp.detach())
        mrope, _ = model.model.get_rope_index(
            input_ids=s["input_ids"], mm_token_type_ids=s["mm_token_type_ids"], image_grid_thw=s["image_grid_thw"]
        )
        positions.append(mrope)
    lp = token_log_probs(model(input_ids=text_only).logits, text_only)[0]
    lp.sum().backward()
    ref_lp.append(lp.detach())
    positions.append(torch.arange(9).view(1, 1, 9).expand(3, 1, 9))
    ref_grads = _grads(model)
    model.zero_grad()

    ids = torch.cat([s["input_ids"] for s in samples] + [text_only], dim=1)
    lengths = [x.shape[1] for x in [s["input_ids"] for s in samples] + [text_only]]
    pos = torch.cat(positions, dim=-1)
    if rows == 4:
        pos = torch.cat([packed_positions(lengths)[None], pos], dim=0)
    patched = patched_copy(model)
    vision = {
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
    }
    out = patched(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False, **vision)
    loss, start = 0.0, 0
    for n, ref in zip(lengths, ref_lp):
        lp = token_log_probs(out.logits[:, start : start + n], ids[:, start : start + n])[0]
        torch.testing.assert_close(lp, ref, atol=ATOL, rtol=0)
        loss = loss + lp.sum()
        start += n
    loss.backward()
    got = _grads(patched)
    _assert_grads_close(ref_grads, got)
    assert any("visual" in n for n in ref_grads), "vision tower should receive gradients"


def test_vl_text_only_batch_runs_vision_tower(tiny_models):
    """A text-only micro-batch still touches every vision weight (FSDP needs identical collectives per rank)."""
    patched = patched_copy(tiny_models("vl"))
    gen = torch.Generator().manual_seed(4)
    ids = random_ids(8, gen)
    ref = tiny_models("vl")(input_ids=ids).logits
    out = patched(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    out.sum().backward()
    for name, p in patched.named_parameters():
        if "visual" in name:
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_padded_batch_matches_unpadded(tiny_models, kind):
    """Left and right padding must not change real tokens; gradients stay finite."""
    model = tiny_models(kind)
    gen = torch.Generator().manual_seed(5)
    lens, length = [9, 4, 6], 9
    seqs = [random_ids(n, gen) for n in lens]
    refs = [model(input_ids=s).logits[0] for s in seqs]
    pad_id = model.config.get_text_config().pad_token_id
    ids = torch.full((3, length), pad_id)
    mask = torch.zeros(3, length, dtype=torch.long)
    ids[0], mask[0] = seqs[0][0], 1
    ids[1, -4:], mask[1, -4:] = seqs[1][0], 1  # left padded
    ids[2, :6], mask[2, :6] = seqs[2][0], 1  # right padded
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    patched = patched_copy(model, use_remove_padding=False)
    patched.train()
    if kind == "vl":
        pos = pos[None].expand(3, -1, -1)
    out = patched(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    for row, ref in enumerate(refs):
        torch.testing.assert_close(out[row][mask[row].bool()], ref, atol=ATOL, rtol=0)
    assert torch.isfinite(out).all()
    lp = token_log_probs(out, ids)
    (lp * mask[:, 1:]).sum().backward()
    for name, p in patched.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name


def test_stock_left_padding_is_exact(tiny_models):
    """Documents that the stock HF model also handles left padding (zeroed pads feed no state)."""
    model = tiny_models("dense")
    gen = torch.Generator().manual_seed(6)
    a, b = random_ids(7, gen), random_ids(4, gen)
    ref_b = model(input_ids=b).logits[0]
    ids = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(out[1, 3:], ref_b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "moe", "vl"])
def test_gradient_checkpointing_matches(tiny_models, kind):
    model = tiny_models(kind)
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 11]
    ids = torch.cat([random_ids(n, gen) for n in lengths], 1)
    pos = packed_positions(lengths)

    def run(checkpointing):
        m = patched_copy(model)
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.zero_grad()
        logits = m(input_ids=ids, position_ids=pos, use_cache=False).logits
        (token_log_probs(logits, ids) ** 2).sum().backward()
        return logits.detach(), _grads(m)

    plain_logits, plain = run(False)
    ckpt_logits, ckpt = run(True)
    torch.testing.assert_close(ckpt_logits, plain_logits, atol=ATOL, rtol=0)
    _assert_grads_close(plain, ckpt)


def test_reentrant_checkpointing_propagates_grads(tiny_models):
    m = patched_copy(tiny_models("dense"))
    m.train()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    gen = torch.Generator().manual_seed(8)
    ids = random_ids(12, gen)
    m(input_ids=ids, position_ids=torch.arange(12)[None], use_cache=False).logits.sum().backward()
    layer_grad = m.model.layers[0].linear_attn.in_proj_qkv.weight.grad
    assert layer_grad is not None and torch.count_nonzero(layer_grad) > 0


def test_explicit_cu_seqlens_override(tiny_models):
    model = tiny_models("dense")
    gen = torch.Generator().manual_seed(9)
    a, b = random_ids(5, gen), random_ids(6, gen)
    patched = patched_copy(model)
    ids = torch.cat([a, b], 1)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    # Positions that do not restart: only the explicit boundaries can split the row.
    out = patched.model(input_ids=ids, position_ids=torch.arange(11)[None], cu_seqlens=cu).last_hidden_state
    ref = model.model(input_ids=b).last_hidden_state
    torch.testing.assert_close(out[0, 5:], ref[0], atol=ATOL, rtol=0)


def test_vl_positions_derived_when_absent(tiny_models):
    model = tiny_models("vl")
    sample = make_image_sample(2, (1, 4, 4), 4, torch.Generator().manual_seed(10))
    ref = model(**sample).logits
    no_type_ids = {k: v for k, v in sample.items() if k != "mm_token_type_ids"}
    out = patched_copy(model)(**no_type_ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "vl"])
def test_cached_decoding_uses_stock_path(tiny_models, kind):
    model = tiny_models(kind)
    ids = random_ids(6, torch.Generator().manual_seed(11))
    patched = patched_copy(model)
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
    got = patched.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
    assert torch.equal(got, ref)
