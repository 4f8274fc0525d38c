"""Speculative decoding with the MTP head in the hf engine (mtp.enable_rollout), CPU, tiny fp32 Qwen3.5."""

import math

import pytest
import torch

from verl.models.qwen3_5.tiny import build_tiny_qwen3_5, make_mtp_head_exact
from verl.workers.rollout.base import GenerationRequest, SamplingParams
from verl.workers.rollout.hf_engine.engine import DecodeEngine, EngineOptions
from verl.workers.rollout.hf_engine.entry import build_sequences
from verl.workers.rollout.hf_engine.runner import runner_class
from verl.workers.rollout.hf_engine.sampling import SamplerConfig
from verl.workers.rollout.hf_engine.spec_sampling import sampling_probs, verify


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


_MODELS = {}


def tiny(kind, layer_scale=None, mtp_scale=0.0):
    key = (kind, layer_scale, mtp_scale)
    if key not in _MODELS:
        m = build_tiny_qwen3_5(None, kind=kind, seed=0, with_tokenizer=False, initializer_range=0.2,
                               mtp_num_hidden_layers=1).eval()
        # make_mtp_head_exact: with layer_scale 0 every draft is right; 0.1 about half; mtp_scale keeps the head's layer
        _MODELS[key] = make_mtp_head_exact(m, layer_scale, mtp_scale) if layer_scale is not None else m
    return _MODELS[key]


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(30, 120, (n,), generator=g).tolist() for n in lengths]


def run(model, ps, k, temperature=0.0, max_tokens=12, slots=3, stop=(), n=1, seed=1, top_k=-1, top_p=1.0):
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=n, top_k=top_k, top_p=top_p)
    seqs, _ = build_sequences([GenerationRequest(p) for p in ps], params, model.config, seed)
    if isinstance(max_tokens, list):
        for s, m in zip(seqs, max_tokens):
            s.max_new = m
    opt = EngineOptions(max_num_seqs=slots, use_cuda_graph=False, num_speculative_tokens=k)
    engine = DecodeEngine(runner_class(model.config)(model, "torch"),
                          SamplerConfig(temperature=temperature, top_k=top_k, top_p=top_p), list(stop), opt)
    return engine.run(seqs), dict(opt.stats)


def assert_same(base, spec, tol):
    for a, b in zip(base, spec):
        assert a.tokens == b.tokens
        assert a.finish_reason == b.finish_reason
        assert max((abs(x - y) for x, y in zip(a.log_probs, b.log_probs)), default=0.0) < tol


# ------------------------------------------------------------------------------------------ greedy parity
@pytest.mark.parametrize("kind,tol", [("dense", 2e-5), ("moe", 5e-5)])
@pytest.mark.parametrize("layer_scale", [None, 0.1])
def test_greedy_speculative_equals_plain(kind, tol, layer_scale):
    """Token for token and log-prob for log-prob the plain engine's output: several prompt lengths (one of a
    single token) in fewer slots than sequences (continuous batching), k = 1 .. 3, a random head (drafts
    rejected) and a near-exact head (runs of accepted drafts, so every rewind depth of the Gated DeltaNet states)."""
    model = tiny(kind, layer_scale)
    ps = prompts([5, 11, 1, 8, 3])
    base, _ = run(model, ps, 0)
    for k in (1, 2, 3):
        spec, stats = run(model, ps, k)
        assert_same(base, spec, tol)
        if layer_scale is not None:
            assert 0.1 < stats["spec_accept_rate"] < 1.0, stats  # partial acceptance: rewinds happen
            assert stats["spec_accept_length"] > 1.2


def test_greedy_with_stop_tokens_inside_accepted_drafts_and_budgets():
    """EOS inside a run of accepted drafts ends the sequence there (the stop token kept, nothing after it), and
    per-sequence max_new limits cut a step's accepted tokens; both equal the plain engine."""
    model = tiny("dense", 0.0)  # exact drafter: every step accepts all k drafts
    ps = prompts([4, 7, 6, 9])
    free, _ = run(model, ps, 0, max_tokens=16)
    # stop tokens that the plain run emits mid-sequence, at positions that are not step boundaries for k = 3
    stop = {free[0].tokens[5], free[1].tokens[2]}
    budgets = [16, 7, 5, 2]
    base, _ = run(model, ps, 0, max_tokens=budgets, stop=stop)
    assert any(r.finish_reason == "stop" for r in base) and any(r.finish_reason == "length" for r in base)
    for k in (1, 3):
        spec, stats = run(model, ps, k, max_tokens=budgets, stop=stop)
        assert_same(base, spec, 2e-5)
        assert stats["spec_accept_rate"] > 0.99  # the drafter is exact here
        assert stats["spec_accept_length"] > 1.9
    assert [len(r.tokens) for r in base] == [len(r.tokens) for r in spec]


def test_acceptance_is_low_for_a_random_head():
    _, stats = run(tiny("dense"), prompts([5, 9]), 1, max_tokens=10)
    assert stats["spec_accept_rate"] < 0.2
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] == stats["spec_verify_steps"]


def test_sampling_returns_target_log_probs():
    """T = 1 and T = 0.7 with top-k: the log-probs the speculative engine returns are the target model's, under
    softmax(logits / T) over the whole vocabulary (a full forward over prompt + response recomputes them)."""
    model = tiny("dense", 0.1)
    ps = prompts([6, 3])
    for temperature, top_k in ((1.0, -1), (0.7, 20)):
        out, stats = run(model, ps, 2, temperature=temperature, top_k=top_k, max_tokens=10)
        assert stats["spec_accepted_tokens"] > 0
        for p, r in zip(ps, out):
            ids = torch.tensor([p + r.tokens])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(p) - 1 : -1].float() / temperature
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.tokens)[:, None]).squeeze(-1)
            assert torch.allclose(ref, torch.tensor(r.log_probs), atol=5e-5)


def test_sampling_is_reproducible_for_a_seed():
    model = tiny("dense", 0.1)
    a, _ = run(model, prompts([5, 4]), 1, temperature=1.0, seed=3)
    b, _ = run(model, prompts([5, 4]), 1, temperature=1.0, seed=3, slots=1)
    assert [r.tokens for r in a] == [r.tokens for r in b]


# ------------------------------------------------------------------------------------------ distribution
def _chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma, series form)."""
    a, z = dof / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 1
    while term > 1e-12 * total:
        term *= z / (a + n)
        total += term
        n += 1
    lower = math.exp(a * math.log(z) - z - math.lgamma(a)) * total if z > 0 else 0.0
    return max(0.0, 1.0 - lower)


def _chi2_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs``, bins with expected count < 5 merged."""
    if counts[probs <= 0].sum() > 0:
        return 0.0  # a token the distribution cannot produce was drawn
    n = counts.sum().item()
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    e = torch.cat([exp[big].double(), exp[~big].sum().double()[None]])
    keep = e > 0
    stat = (((obs - e) ** 2)[keep] / e[keep]).sum().item()
    dof = int(keep.sum()) - 1
    return _chi2_sf(stat, dof) if dof > 0 else 1.0  # one possible token: nothing to test beyond the line above


def test_engine_token_distribution_matches_the_target():
    """T = 1, k = 2, a drafter right about half the time: the second and third tokens (both produced by
    speculative steps: accepted drafts, residual draws and bonus tokens) follow the model's exact marginals."""
    model = tiny("dense", 0.05)
    p = prompts([4], seed=5)[0]
    n = 3000
    out, stats = run(model, [p], 2, temperature=1.0, max_tokens=3, slots=n, n=n, seed=11)
    assert 0.2 < stats["spec_accept_rate"] < 0.95, stats
    toks = torch.tensor([r.tokens for r in out])
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=torch.tensor([p])).logits[0, -1].float(), -1)  # (V,)
        vocab = p1.shape[0]
        ids = torch.cat([torch.tensor([p]).expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        p2_given = torch.softmax(model(input_ids=ids).logits[:, -1].float(), -1)  # (V, V)
    p2 = p1 @ p2_given
    assert _chi2_fit(torch.bincount(toks[:, 1], minlength=vocab), p2) > 1e-3
    # third token given the first two, for the most frequent prefix
    pairs, counts = torch.unique(toks[:, :2], dim=0, return_counts=True)
    top = pairs[counts.argmax()]
    rows = (toks[:, :2] == top).all(1)
    with torch.no_grad():
        p3 = torch.softmax(model(input_ids=torch.tensor([p + top.tolist()])).logits[0, -1].float(), -1)
    assert rows.sum() > 100
    assert _chi2_fit(torch.bincount(toks[rows, 2], minlength=vocab), p3) > 1e-3
    # and the first-token stream is the plain engine's own (prefill samples as before)
    plain, _ = run(model, [p], 0, temperature=1.0, max_tokens=1, slots=n, n=n, seed=11)
    assert [r.tokens[0] for r in plain] == toks[:, 0].tolist()


# ------------------------------------------------------------------------------------------ the rule itself
def _synthetic(b, k, vocab, seed, same=False):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(k + 1, vocab, generator=g) * 1.5
    # a draft close to the target but not equal (so some drafts are kept and some replaced)
    draft = target[:k].clone() if same else target[:k] + torch.randn(k, vocab, generator=g)
    return target[None].expand(b, -1, -1).contiguous(), draft[None].expand(b, -1, -1).contiguous()


@pytest.mark.parametrize("cfg", [SamplerConfig(1.0), SamplerConfig(0.8, top_k=4), SamplerConfig(1.0, top_p=0.7)])
def test_rule_emits_the_target_distribution(cfg):
    """Context-free synthetic distributions, many rows with their own keys: the first emitted token follows the
    target's first distribution, and the second (where the first draft was kept) the target's second."""
    b, k, vocab = 40000, 2, 6
    target, draft = _synthetic(b, k, vocab, seed=0)
    keys = torch.arange(b, dtype=torch.long) * 7919 % (2**31)
    steps = torch.zeros(b, dtype=torch.long)
    q = sampling_probs(draft.reshape(-1, vocab), cfg, None).reshape(b, k, vocab)
    drafts = torch.stack([torch.multinomial(q[0, j], b, replacement=True, generator=torch.Generator().manual_seed(j))
                          for j in range(k)], 1)
    tokens, log_probs, accepted = verify(target, drafts, q, cfg, keys, steps, None)
    p = sampling_probs(target[0], cfg, None)
    assert _chi2_fit(torch.bincount(tokens[:, 0], minlength=vocab), p[0]) > 1e-3
    second = accepted >= 1
    assert _chi2_fit(torch.bincount(tokens[second, 1], minlength=vocab), p[1]) > 1e-3
    assert 0 < accepted.float().mean() < k
    # log-probs: the target's, at temperature T, over the whole vocabulary
    ref = torch.log_softmax(target[0].float() / cfg.temperature, -1)
    assert torch.allclose(log_probs[:, 0], ref[0][tokens[:, 0]], atol=1e-6)


def test_rule_accepts_everything_when_the_draft_is_the_target():
    b, k, vocab = 500, 3, 9
    target, draft = _synthetic(b, k, vocab, seed=1, same=True)
    cfg = SamplerConfig(1.0)
    q = sampling_probs(draft.reshape(-1, vocab), cfg, None).reshape(b, k, vocab)
    drafts = torch.stack([torch.multinomial(q[0, j], b, replacement=True) for j in range(k)], 1)
    keys = torch.arange(b, dtype=torch.long)
    _, _, accepted = verify(target, drafts, q, cfg, keys, torch.zeros(b, dtype=torch.long), None)
    assert (accepted == k).all()
    greedy = SamplerConfig(0.0)
    best = target[:, :k].argmax(-1)
    tokens, _, accepted = verify(target, best, None, greedy, keys, torch.zeros(b, dtype=torch.long), None)
    assert (accepted == k).all() and (tokens[:, :k] == best).all()
    # and a draft that is never the arg-max is never kept
    wrong = (best + 1) % vocab
    tokens, _, accepted = verify(target, wrong, None, greedy, keys, torch.zeros(b, dtype=torch.long), None)
    assert (accepted == 0).all() and (tokens[:, 0] == best[:, 0]).all()


# ------------------------------------------------------------------------------------------ the drafter's cache
def _mtp_reference_logits(model, ids: list[int]) -> torch.Tensor:
    """The MTP head over a whole sequence with the stock HF decoder layer (causal), as in training: row t predicts
    token t + 2 from the main model's final hidden state at t and the embedding of token t + 1."""
    x_ids = torch.tensor([ids])
    t = len(ids) - 1
    with torch.no_grad():
        h = model.model(input_ids=x_ids).last_hidden_state[:, :t]
        mtp, text = model.mtp, model.model
        emb = text.embed_tokens(x_ids[:, 1:])
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(h)], -1))
        pos = torch.arange(t)[None]
        cos, sin = text.rotary_emb(x, pos[None].expand(3, 1, t))
        mask = torch.full((t, t), -1e9).triu(1)[None, None]
        x = mtp.layers[0](x, position_embeddings=(cos, sin), attention_mask=mask)
        x = x[0] if isinstance(x, tuple) else x
        return model.lm_head(mtp.norm(x))[0]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_drafter_cache_stays_consistent(kind):
    """Every first draft is the MTP head's prediction over the whole sequence so far: the drafter's KV cache
    (prompt prefill, catch-up over accepted tokens, provisional multi-step entries overwritten) equals a fresh
    forward's, whatever the acceptance pattern."""
    model = tiny(kind, 0.1, mtp_scale=1.0)  # the head's attention and MLP at full strength
    ps = prompts([6, 3, 9])
    cls = runner_class(model.config)
    seen = []
    original = cls.draft_first

    def recording(self, cache, b):
        logits, hidden = original(self, cache, b)
        seen.append((int(cache.keys[0]), int(cache.lengths[0]), bool(cache.done[0]), logits[0].clone()))
        return logits, hidden

    cls.draft_first = recording
    try:
        out, stats = run(model, ps, 2, slots=1, max_tokens=10)  # one slot: the sequences in admission order
    finally:
        cls.draft_first = original
    assert 0.05 < stats["spec_accept_rate"] < 1.0
    order = list(dict.fromkeys(key for key, *_ in seen))  # random-stream keys, one per sequence
    assert len(order) == len(ps)
    checked = 0
    for key, n, done, logits in seen:
        if done:
            continue
        seq = order.index(key)
        full = ps[seq] + out[seq].tokens
        ref = _mtp_reference_logits(model, full[: n + 1])  # positions 0 .. n - 1 (the pending token is n)
        torch.testing.assert_close(logits, ref[n - 1], atol=5e-5, rtol=1e-4)
        checked += 1
    assert checked >= 6


# ------------------------------------------------------------------------------------------ wiring
def _rollout(model, mtp: dict):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl.workers.rollout.hf_rollout import HFRollout

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    model_config = OmegaConf.create({"mtp": mtp})
    return HFRollout(OmegaConf.create({"enforce_eager": True, "max_num_seqs": 4}), model_config, tok, module=model)


def test_rollout_turns_speculation_on_from_the_mtp_section_and_logs_acceptance():
    """actor_rollout_ref.model.mtp.enable + mtp.enable_rollout + mtp.num_speculative_tokens reach the engine
    through the hf rollout; the acceptance figures are logged as perf/hf_engine/spec_* and under upstream's
    rollout/spec_accept_rate / rollout/spec_accept_length (per-request means); outputs equal plain decoding."""
    model = tiny("dense", 0.0)
    reqs = [GenerationRequest(p) for p in prompts([5, 3, 7])]
    params = SamplingParams(temperature=0.0, max_tokens=9)
    plain = _rollout(model, {"enable": True, "enable_rollout": False})
    base = plain.generate(reqs, params)
    assert not any(k.startswith(("rollout/spec", "perf/hf_engine/spec")) for k in plain.engine_metrics)
    spec = _rollout(model, {"enable": True, "enable_rollout": True, "num_speculative_tokens": 3})
    out = spec.generate(reqs, params)
    assert [o[0].token_ids for o in out] == [o[0].token_ids for o in base]
    m = spec.engine_metrics
    assert m["perf/hf_engine/spec_accept_rate"] == pytest.approx(1.0)
    assert m["rollout/spec_accept_rate"] == pytest.approx(1.0)
    # every step gains k + 1 = 4 tokens except where the 9-token budget cuts it (acceptance still counts)
    assert m["rollout/spec_accept_length"] == pytest.approx(4.0)
    assert m["perf/hf_engine/spec_draft_tokens"] == 3 * m["perf/hf_engine/spec_verify_steps"]
    # 8 tokens after the prefill's first: 2 steps of 4 per sequence
    assert m["perf/hf_engine/spec_verify_steps"] == 3 * 2
    # enable_rollout without enable loads no head: plain decoding (the config check refuses it before this)
    assert _rollout(model, {"enable": False, "enable_rollout": True}).generate(reqs, params)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _rollout(model, {"enable": True, "enable_rollout": True, "num_speculative_tokens": 0}).generate(reqs, params)


def test_speculation_needs_a_head_and_refuses_route_recording():
    plain = build_tiny_qwen3_5(None, kind="dense", seed=0, with_tokenizer=False)
    with pytest.raises(ValueError, match="mtp.enable=true"):
        run(plain, prompts([4]), 1)
    model = tiny("moe")
    opt = EngineOptions(max_num_seqs=2, use_cuda_graph=False, num_speculative_tokens=1, record_routes=True)
    seqs, _ = build_sequences([GenerationRequest(p) for p in prompts([4])], SamplingParams(max_tokens=3),
                              model.config, 0)
    with pytest.raises(ValueError, match="enable_rollout_routing_replay"):
        DecodeEngine(runner_class(model.config)(model, "torch"), SamplerConfig(0.0), [], opt).run(seqs)


def test_vl_greedy_speculative_equals_plain():
    """A VL checkpoint (mRoPE positions, image placeholders in the prompt): the drafter's prompt positions and the
    verification's rope deltas follow the plain loop's; greedy outputs and log-probs equal it."""
    from tests.workers.rollout.test_hf_engine import _image_request

    model = build_tiny_qwen3_5(None, kind="vl", seed=0, with_tokenizer=False, initializer_range=0.2,
                               mtp_num_hidden_layers=1).eval()
    make_mtp_head_exact(model, 0.01)  # the VL tiny model's layers weigh more: about half the drafts are right
    reqs = [_image_request(4, (1, 4, 4), 3, 0), _image_request(2, (1, 4, 8), 6, 1), GenerationRequest(prompts([6])[0])]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    base = _rollout(model, {"enable": True, "enable_rollout": False}).generate(reqs, params)
    r = _rollout(model, {"enable": True, "enable_rollout": True, "num_speculative_tokens": 2})
    out = r.generate(reqs, params)
    assert r.engine_metrics["perf/hf_engine/spec_accepted_tokens"] > 0
    for a, b in zip(base, out):
        assert a[0].token_ids == b[0].token_ids
        assert max(abs(x - y) for x, y in zip(a[0].log_probs, b[0].log_probs)) < 5e-5
