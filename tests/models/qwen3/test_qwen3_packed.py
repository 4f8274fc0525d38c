"""Qwen3 dense, the second architecture: its packed FSDP forward against the unpatched HF model (tiny random
model, fp32, CPU), and the hf rollout's fallback to ``generate``."""

import copy
import warnings

import pytest
import torch

from verl.models.registry import get_model_spec
from verl.models.transformers.monkey_patch import apply_monkey_patch

LENGTHS = (5, 7, 4)


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      architectures=["Qwen3ForCausalLM"], attn_implementation="sdpa")
    stock = Qwen3ForCausalLM(cfg).eval()
    patched = apply_monkey_patch(copy.deepcopy(stock))
    return stock, patched


def _seqs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g) for n in LENGTHS]


def test_spec_is_registered_by_its_package():
    from transformers import Qwen3Config

    spec = get_model_spec(Qwen3Config(architectures=["Qwen3ForCausalLM"]))
    assert spec.family == "qwen3" and spec.native_packing and not spec.supports_ulysses
    assert spec.resolve("patches").__module__ == "verl.models.qwen3.hf_patch" and spec.hf_runner is None
    assert get_model_spec(Qwen3Config()).architecture == "Qwen3ForCausalLM"  # by model_type alone


@torch.no_grad()
def test_packed_row_matches_each_sequence_alone(models):
    """Three sequences in one (1, T) row, position ids restarting at 0: no attention across their boundaries."""
    stock, patched = models
    seqs = _seqs()
    row = torch.cat(seqs).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    got = patched(input_ids=row, position_ids=positions).logits[0]
    want = torch.cat([stock(input_ids=s.unsqueeze(0)).logits[0] for s in seqs])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the stock model on the same row lets later sequences see earlier ones: the test can tell them apart
    crossing = stock(input_ids=row, position_ids=positions).logits[0]
    assert not torch.allclose(crossing[LENGTHS[0]:], want[LENGTHS[0]:], atol=1e-3)


@torch.no_grad()
def test_padded_rows_match_the_stock_model(models):
    stock, patched = models
    seqs = _seqs(seed=2)
    width = max(LENGTHS)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left padding, as prompts are laid out
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    got = patched(input_ids=ids, attention_mask=mask).logits
    for i, s in enumerate(seqs):
        want = stock(input_ids=s.unsqueeze(0)).logits[0]
        torch.testing.assert_close(got[i, width - len(s):], want, rtol=1e-5, atol=1e-5)


def test_packed_gradients_match(models):
    stock, patched = models
    seqs = _seqs(seed=3)
    row = torch.cat(seqs).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    patched.zero_grad()
    stock.zero_grad()
    patched(input_ids=row, position_ids=positions).logits.float().square().mean().backward()
    loss = sum(stock(input_ids=s.unsqueeze(0)).logits.float().square().sum() for s in seqs) / (row.numel() * 96)
    loss.backward()
    for (name, a), (_, b) in zip(patched.named_parameters(), stock.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


@torch.no_grad()
def test_generate_runs_the_stock_cached_path(models):
    stock, patched = models
    prompt = _seqs(seed=4)[1].unsqueeze(0)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(prompt, **kw), stock.generate(prompt, **kw))


def test_hf_rollout_falls_back_to_generate_with_a_warning(models):
    from types import SimpleNamespace

    from verl.workers.rollout.hf_rollout import HFRollout

    _, patched = models
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    with pytest.warns(UserWarning, match="no hf-engine decode runner for Qwen3ForCausalLM"):
        rollout = HFRollout({}, None, tok, module=patched)
    assert rollout.decode_engine is False
