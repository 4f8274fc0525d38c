"""GPU checks of the hf decode loop: fla's in-place recurrent step vs the torch reference, the split-K decode
attention vs an fp64 softmax, CUDA-graph replay vs eager decoding, greedy parity with ``generate`` through the
fla kernels, and PyTorch's native varlen attention vs the padded SDPA fallback. Run with ``pytest -m gpu`` (scripts/gpu_rollout.sh does)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Head dims the fused Triton decode kernels take (the default tiny dims, 16, do not): with these the decode step
# runs decode_kernels's fused norms, conv, gates and delta rule.
FUSED_DIMS = dict(linear_key_head_dim=32, linear_value_head_dim=64)


def _needs_fla():
    from verl.models.qwen3_5.hf_runner import _fla_recurrent_kernel

    if _fla_recurrent_kernel() is None:
        pytest.skip("fla is not importable")


@cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "fla"])
def test_recurrent_step_kernels_match_torch(state_dtype, backend):
    from verl.models.qwen3_5.hf_runner import fla_recurrent_step_, torch_recurrent_step_

    if backend == "fla":
        _needs_fla()
        step = fla_recurrent_step_
    else:
        from verl.models.qwen3_5.decode_kernels import gdn_decode_step_ as step

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, hv, dk, dv = 7, 4, 8, 128, 128
    q = torch.randn(b, 1, h, dk, device="cuda", generator=g)
    k = torch.randn(b, 1, h, dk, device="cuda", generator=g)
    v = torch.randn(b, 1, hv, dv, device="cuda", generator=g)
    gate = -torch.rand(b, 1, hv, device="cuda", generator=g)
    beta = torch.rand(b, 1, hv, device="cuda", generator=g)
    state = (torch.randn(b, hv, dk, dv, device="cuda", generator=g) * 0.1).to(state_dtype)
    s_fla, s_ref = state.clone(), state.clone()
    for _ in range(3):  # a few tokens, state carried in place
        o_fla = step(q, k, v, gate, beta, s_fla)
        o_ref = torch_recurrent_step_(q, k, v, gate, beta, s_ref)
    tol = dict(rtol=1e-4, atol=1e-4) if state_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o_fla.float(), o_ref.float(), **tol)
    torch.testing.assert_close(s_fla.float(), s_ref.float(), **tol)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_kernel_reads_only_visible_keys(dtype):
    """The split-K decode attention at the 9B's head shape (16 query / 4 kv heads x 256) over a 5k allocation, at
    positions on, before and after chunk boundaries, vs an fp32 softmax over keys 0 .. pos. The keys past each
    slot's position are NaN: a kernel that read them would return NaN."""
    from verl.models.qwen3_5.decode_kernels import decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, hkv, grp, length, d = 6, 4, 4, 5200, 256
    kv = torch.randn(2, 8, hkv, length, d, device="cuda", generator=g).to(dtype)  # 8 slots, the first b used
    pos = torch.tensor([0, 255, 256, 1023, 3000, length - 1], device="cuda")
    for i, p in enumerate(pos.tolist()):
        kv[:, i, :, p + 1:] = float("nan")
    q = torch.randn(b, hkv * grp, d, device="cuda", generator=g).to(dtype)
    out = decode_attention(q, kv[0, :b], kv[1, :b], pos, d**-0.5)
    qf, kf, vf = q.double().reshape(b, hkv, grp, d), kv[0, :b].double(), kv[1, :b].double()
    visible = torch.arange(length, device="cuda")[None] <= pos[:, None]
    scores = (qf @ kf.nan_to_num().transpose(-1, -2) * d**-0.5).masked_fill(~visible[:, None, None], float("-inf"))
    ref = (torch.softmax(scores, -1) @ vf.nan_to_num()).reshape(b, -1)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


def _decode_once(model, backend, seed=1):
    """Logits of one decode step over 5 slots whose caches hold the same random values (drawn in fp32, then
    cast: every model dtype starts from identical numbers), and the caches after it."""
    from verl.workers.rollout.hf_engine.cache import SlotCache
    from verl.models.qwen3_5.hf_runner import Qwen35Runner

    runner = Qwen35Runner(model, recurrent_backend=backend)
    assert (runner.fused_kernels() is not None) == (backend == "auto")
    cache = SlotCache(runner.shape, 5, 40, 8, runner.device, runner.dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, std in (("conv", 1.0), ("rec", 0.1), ("kv", 1.0)):
        t = getattr(cache, name)
        t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(torch.bfloat16) * std)
    cache.tokens[:] = torch.tensor([5, 7, 11, 3, 9])
    cache.lengths[:] = torch.tensor([3, 9, 4, 30, 1])
    with torch.no_grad():
        return runner.decode_logits(cache, 5).float(), cache


@cuda
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fused_decode_step_matches_torch_step(kind):
    """One decode step through the fused Triton kernels vs the unfused torch step (torch recurrent reference).
    fp32: logits and every cache agree to 1e-4. bf16: both are compared with the fp32 step, and the fused step
    (fp32 inside its kernels) is no further from it than the unfused one."""
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    model = build_tiny_qwen3_5(None, kind=kind, with_tokenizer=False, initializer_range=0.3, linear_num_key_heads=2,
                               linear_num_value_heads=4, **FUSED_DIMS).to("cuda").eval()
    (fused, a), (ref, b) = _decode_once(model, "auto"), _decode_once(model, "torch")
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused, ref, **tol)
    for name in ("conv", "rec", "kv"):
        torch.testing.assert_close(getattr(a, name).float(), getattr(b, name).float(), **tol, msg=name)
    model = model.to(torch.bfloat16)
    fused16, torch16 = _decode_once(model, "auto")[0], _decode_once(model, "torch")[0]
    err_fused, err_torch = (fused16 - ref).norm() / ref.norm(), (torch16 - ref).norm() / ref.norm()
    print(f"[fused decode] {kind} bf16 relative logit error vs fp32: fused {err_fused:.2e}, torch {err_torch:.2e}")
    assert err_fused <= 1.25 * err_torch + 1e-3


def _rollout(model, **cfg):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl.workers.rollout.hf_rollout import HFRollout

    return HFRollout(OmegaConf.create(cfg), None, SimpleNamespace(pad_token_id=0, eos_token_id=2), module=model)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(30, 120, (n,), generator=g).tolist() for n in lengths]


@cuda
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cuda_graph_decode_matches_eager(kind):
    """MoE included: transformers' grouped_mm experts route on the device, so the decode step is captured."""
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    model = build_tiny_qwen3_5(None, kind=kind, with_tokenizer=False, initializer_range=0.3,
                               **FUSED_DIMS).to("cuda", torch.bfloat16)
    if kind == "moe":
        model.set_experts_implementation("grouped_mm")
    reqs = [GenerationRequest(p) for p in _prompts([5, 17, 9, 30, 12, 3, 8])]
    params = SamplingParams(temperature=1.0, top_k=40, seed=5, max_tokens=24, stop_token_ids=[40, 41, 42])
    graphed = _rollout(model, max_num_seqs=4)
    out_g = graphed.generate(reqs, params)
    assert graphed.last_stats["capture_s"] > 0
    out_e = _rollout(model, max_num_seqs=4, enforce_eager=True).generate(reqs, params)
    for a, b in zip(out_g, out_e):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].log_probs == b[0].log_probs


@cuda
@pytest.mark.parametrize("kind", ["dense", "vl"])
def test_greedy_matches_generate_fp32_on_gpu(kind):
    """The fla paths (varlen conv / chunked rule in prefill, fused recurrent step in decode) against HF
    generate, fp32, with a wide init so that greedy choices are not near ties."""
    _needs_fla()
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    model = build_tiny_qwen3_5(None, kind=kind, with_tokenizer=False, initializer_range=0.3, **FUSED_DIMS).to("cuda")
    ps = _prompts([5, 11, 3, 20])
    outs = _rollout(model, max_num_seqs=3).generate([GenerationRequest(p) for p in ps],
                                                    SamplingParams(temperature=0.0, max_tokens=12))
    for p, o in zip(ps, outs):
        # No min_new_tokens: it would mask the eos id (2) that the engine, with no stop ids here, may pick;
        # generate stops at eos, so the engine's tokens are compared up to there.
        ref = model.generate(input_ids=torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False,
                             pad_token_id=0, eos_token_id=2, suppress_tokens=[11, 12] if kind == "vl" else None)
        ref = ref[0, len(p):].tolist()
        ref = ref[:ref.index(2) + 1] if 2 in ref else ref
        assert o[0].token_ids[:len(ref)] == ref


@cuda
def test_torch_varlen_attention_matches_padded_sdpa(monkeypatch):
    from verl.models.transformers import packed_attention as pa

    if pa._torch_varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [37, 300, 5, 129]
    total = sum(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(total, 8, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(total, 2, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(total, 2, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    outs, grads = {}, {}
    for backend in ("torch_varlen", "sdpa"):
        monkeypatch.setenv(pa.BACKEND_ENV, backend)
        out = pa.varlen_causal_attention(q, k, v, cu, max(lens), 256**-0.5)
        out.float().square().sum().backward()
        outs[backend] = out.detach().float()
        grads[backend] = [t.grad.float().clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    torch.testing.assert_close(outs["torch_varlen"], outs["sdpa"], rtol=2e-2, atol=2e-2)
    for a, b in zip(grads["torch_varlen"], grads["sdpa"]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
    monkeypatch.delenv(pa.BACKEND_ENV)
    assert pa.packed_attention_backend(q) in ("flash_attn", "torch_varlen")


@cuda
def test_session_across_chunks_with_cuda_graphs_matches_each_chunk_alone():
    """The engine session's thread captures and replays the decode graphs while chunks join the running batch;
    each chunk's tokens equal the chunk generated alone (fp32)."""
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.rollout.base import GenerationRequest, SamplingParams
    from verl.workers.rollout.hf_engine.entry import build_sequences, open_engine
    from verl.workers.rollout.hf_engine.session import EngineSession

    model = build_tiny_qwen3_5(None, kind="dense", with_tokenizer=False, initializer_range=0.3,
                               **FUSED_DIMS).to("cuda", torch.float32)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, stop_token_ids=[40, 41, 42])
    chunks = [[GenerationRequest(p) for p in _prompts(lengths, seed=s)]
              for s, lengths in enumerate(([5, 17, 9], [30, 12, 3], [8, 6]))]
    r = _rollout(model, max_num_seqs=4)
    alone = [r.generate(reqs, params) for reqs in chunks]
    with open_engine(r, params) as engine:
        session = EngineSession(engine, capacity=4, max_len=64, max_new=24)
        try:
            for k, reqs in enumerate(chunks):
                session.submit(k, build_sequences(reqs, params, model.config, params.seed)[0])
            got = [session.collect(k) for k in range(len(chunks))]
        finally:
            session.close()
    assert sum(st["capture_s"] for _, st in got) > 0  # graphs ran
    for (res, _), outs in zip(got, alone):
        assert [x.tokens for x in res] == [o[0].token_ids for o in outs]


@cuda
def test_session_partial_rollout_keeps_the_cuda_graphs_valid():
    """Partial rollout under CUDA graphs (fp32): the session's thread captured the decode graphs, then pauses
    between rounds; new weights are copied into the same parameter storage (load_hf_weights, in place) and the
    live prefixes re-prefilled. A pause with the same weights keeps every token; with new weights each token's
    log-prob equals a recompute under the version it carries (a graph reading stale weights would fail it)."""
    import copy

    from tests.workers.rollout.test_hf_engine_partial import run_paused
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.rollout.base import GenerationRequest, SamplingParams
    from verl.workers.weight_sync.receive import load_hf_weights

    def build(seed):
        return build_tiny_qwen3_5(None, kind="dense", seed=seed, with_tokenizer=False, initializer_range=0.02,
                                  **FUSED_DIMS).to("cuda", torch.float32)

    old, new = build(0), build(1)
    model = copy.deepcopy(old)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24)
    chunks = [[GenerationRequest(p) for p in _prompts(lengths, seed=s)]
              for s, lengths in enumerate(([5, 17, 9], [30, 12, 3]))]
    r = _rollout(model, max_num_seqs=4)
    plain, _ = run_paused(r, chunks, params)
    same, st_same = run_paused(r, chunks, params, at=(2, 4))
    assert sum(st["capture_s"] for st in st_same) > 0 and sum(st["reprefills"] for st in st_same) > 0
    assert [x.tokens for x in sum(same, [])] == [x.tokens for x in sum(plain, [])]

    def install():
        load_hf_weights(model, list(new.named_parameters()))

    got, stats = run_paused(r, chunks, params, at=(2,), swaps=[install])
    assert sum(st["capture_s"] for st in stats) > 0 and sum(st["reprefills"] for st in stats) > 0
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # copied in place
    mixed = 0
    for reqs, results in zip(chunks, got):
        for req, res in zip(reqs, results):
            ids = torch.tensor([list(req.prompt_token_ids) + res.tokens], device="cuda")
            with torch.no_grad():
                lp = [torch.log_softmax(m(input_ids=ids, use_cache=False).logits[0].float(), -1) for m in (old, new)]
            version = [0] * len(res.tokens)
            for start, v in res.versions:
                version[start:] = [v] * (len(res.tokens) - start)
            n0 = len(req.prompt_token_ids) - 1
            ref = torch.stack([lp[v][n0 + t, tok] for t, (v, tok) in enumerate(zip(version, res.tokens))])
            torch.testing.assert_close(torch.tensor(res.log_probs, device="cuda"), ref, rtol=0, atol=2e-4)
            mixed += 0 in version and 1 in version
    assert mixed
