"""The fused decode sampler (torch path, CPU) against the unfused sampler it replaced and against softmax."""

import pytest
import torch

from tests.workers.rollout.sampler_reference import reference_sample
from verl.workers.rollout.hf_engine.fused_sampler import fused_sample, torch_fused_sample
from verl.workers.rollout.hf_engine.sampling import SamplerConfig, counter_uniform, sample_tokens

# Chi-square critical values at p = 0.001 (df: value): a correct sampler exceeds them once in a thousand seeds.
CHI2_999 = {9: 27.88, 11: 31.26}


def _draws(n: int):
    keys = torch.arange(n) * 7919 % (2**31 - 1)
    steps = torch.arange(n) % 13
    return keys, steps


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    seen = torch.bincount(tokens, minlength=probs.numel()).double()
    keep = probs > 0
    expected = probs.double()[keep] * tokens.numel()
    assert seen[~keep].sum() == 0, "drew a token of zero probability"
    return float(((seen[keep] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature,suppress", [(1.0, None), (0.7, [3, 5])])
def test_distribution_matches_softmax(temperature, suppress):
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(1)) * 1.5
    n = 30000
    keys, steps = _draws(n)
    sup = None if suppress is None else torch.tensor(suppress)
    probs = torch.softmax(logits[0] / temperature, -1)
    if sup is not None:
        probs = probs.index_fill(0, sup, 0.0)
        probs = probs / probs.sum()
    df = int((probs > 0).sum()) - 1
    tok, lp = torch_fused_sample(logits.expand(n, -1), temperature, counter_uniform(keys, steps), sup)
    assert _chi2(tok, probs) < CHI2_999[df]
    torch.testing.assert_close(lp, torch.log_softmax(logits[0] / temperature, -1)[tok])
    # the oracle itself passes the same test, and the chi-square does fail for the wrong temperature
    ref_tok, _ = reference_sample(logits.expand(n, -1), temperature, keys, steps, sup)
    assert _chi2(ref_tok, probs) < CHI2_999[df]
    wrong, _ = torch_fused_sample(logits.expand(n, -1), 2.0 * temperature, counter_uniform(keys, steps), sup)
    assert _chi2(wrong, probs) > 10 * CHI2_999[df]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_match_the_unfused_sampler(dtype):
    """Same uniforms -> the same token on (nearly) every row; log-probs as the unfused sampler's."""
    n, vocab = 4000, 1000
    logits = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    keys, steps = _draws(n)
    sup = torch.tensor([0, 17])
    tok, lp = torch_fused_sample(logits, 0.8, counter_uniform(keys, steps), sup)
    ref_tok, ref_lp = reference_sample(logits, 0.8, keys, steps, sup)
    assert (tok == ref_tok).float().mean() > 0.999  # a boundary can move with the summation order
    same = tok == ref_tok
    torch.testing.assert_close(lp[same], ref_lp[same], rtol=0, atol=1e-5)
    assert not torch.isin(tok, sup).any()


def test_greedy_and_top_k_1_are_exact():
    n, vocab = 64, 500
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(3))
    logits[5] = 0.25  # a row of ties: the first index wins, as torch.argmax
    keys, steps = _draws(n)
    sup = torch.tensor([int(logits[0].argmax())])
    for s in (None, sup):
        tok, lp = fused_sample(logits, 1.0, None, s)
        ref_tok, ref_lp = reference_sample(logits, 0.0, None, None, s)
        assert torch.equal(tok, ref_tok)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
        greedy, _ = sample_tokens(logits, SamplerConfig(temperature=0.0), keys, steps, s)
        top1, _ = sample_tokens(logits, SamplerConfig(temperature=0.9, top_k=1), keys, steps, s)
        assert torch.equal(greedy, ref_tok) and torch.equal(top1, ref_tok)
    assert int(tok[0]) != int(sup[0]) and int(tok[5]) == 0


def test_sample_tokens_routes_plain_temperature_through_the_fused_path(monkeypatch):
    from verl.workers.rollout.hf_engine import fused_sampler

    calls = []
    real = fused_sampler.fused_sample
    monkeypatch.setattr(fused_sampler, "fused_sample", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    logits = torch.randn(4, 30)
    keys, steps = _draws(4)
    sample_tokens(logits, SamplerConfig(temperature=0.6), keys, steps)
    sample_tokens(logits, SamplerConfig(temperature=0.0), keys, steps)
    sample_tokens(logits, SamplerConfig(temperature=0.6, top_p=0.9), keys, steps)  # filtered: not fused
    assert calls == [0.6, 1.0]
