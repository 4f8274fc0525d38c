"""The hf rollout's own Qwen3.5 decode loop (verl.workers.rollout.hf_engine) on tiny fp32 models, CPU."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from verl.models.tiny import tiny_vocab
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
from verl.workers.rollout.base import GenerationRequest, SamplingParams
from verl.workers.rollout.hf_engine.sampling import SamplerConfig, counter_uniform, sample_tokens
from verl.workers.rollout.hf_rollout import HFRollout

VOCAB = tiny_vocab()
IMAGE_PAD = VOCAB["<|image_pad|>"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


_MODELS = {}


def tiny(kind, init=0.3):
    # A wide init makes the random model's next-token distribution far from uniform, so greedy decoding
    # walks through many different tokens (a narrow one repeats one token and would prove little).
    if (kind, init) not in _MODELS:
        _MODELS[kind, init] = build_tiny_qwen3_5(None, kind=kind, seed=0, with_tokenizer=False, initializer_range=init)
    return _MODELS[kind, init]


def rollout(model, **cfg):
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=VOCAB["<|im_end|>"])
    return HFRollout(OmegaConf.create({"enforce_eager": True, **cfg}), None, tok, module=model)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(30, 120, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, ids, n_new, **extra):
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=0, **extra)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_matches_generate(kind):
    model = tiny(kind)
    ps = prompts([5, 11, 3, 8])
    outs = rollout(model, max_num_seqs=3).generate([GenerationRequest(p) for p in ps],
                                                   SamplingParams(temperature=0.0, max_tokens=10))
    for p, o in zip(ps, outs):
        assert o[0].token_ids == hf_greedy(model, p, 10)
        assert o[0].finish_reason == "length"


def _image_request(n_before, grid, n_after, seed):
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    ids = (torch.randint(30, 120, (n_before,), generator=g).tolist()
           + [VOCAB["<|vision_start|>"], IMAGE_PAD, VOCAB["<|vision_end|>"]]
           + torch.randint(30, 120, (n_after,), generator=g).tolist())
    pixels = torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=g)
    outs = {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid])}
    return GenerationRequest(ids, multi_modal_data={"image": [None], "processor_outputs": outs})


def test_vl_greedy_matches_generate():
    model = tiny("vl")
    reqs = [_image_request(4, (1, 4, 4), 3, 0), _image_request(2, (1, 4, 8), 6, 1), GenerationRequest(prompts([6])[0])]
    r = rollout(model, max_num_seqs=2)
    outs = r.generate(reqs, SamplingParams(temperature=0.0, max_tokens=8))
    from verl.workers.rollout.vision_tokens import expand_vision_tokens

    for req, o in zip(reqs, outs):
        ids = expand_vision_tokens(req, model.config)
        # the engine never samples a vision placeholder (it would have no pixels in the training forward)
        extra = {"suppress_tokens": [IMAGE_PAD, VOCAB["<|video_pad|>"]]}
        mm = (req.multi_modal_data or {}).get("processor_outputs")
        if mm:
            t = torch.tensor([ids])
            extra.update(pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
                         mm_token_type_ids=(t == IMAGE_PAD).int())
        assert o[0].token_ids == hf_greedy(model, ids, 8, **extra)


def test_sampling_is_reproducible_and_seeded():
    model = tiny("dense")
    reqs = [GenerationRequest(p) for p in prompts([4, 9, 6])]
    params = dict(temperature=1.0, top_k=50, max_tokens=12)
    a = rollout(model).generate(reqs, SamplingParams(seed=7, **params))
    b = rollout(model).generate(reqs, SamplingParams(seed=7, **params))
    c = rollout(model).generate(reqs, SamplingParams(seed=8, **params))
    toks = lambda outs: [o[0].token_ids for o in outs]  # noqa: E731
    assert toks(a) == toks(b)
    assert toks(a) != toks(c)
    assert [o[0].log_probs for o in a] == [o[0].log_probs for o in b]


def test_n_samples_share_a_prefill_but_differ():
    model = tiny("dense")
    r = rollout(model)
    p = prompts([7])[0]
    outs = r.generate([GenerationRequest(p), GenerationRequest(p)], SamplingParams(n=3, temperature=1.0, seed=1,
                                                                                   max_tokens=10))
    samples = [o.token_ids for group in outs for o in group]
    assert len(samples) == 6 and len({tuple(s) for s in samples}) == 6  # six distinct streams
    assert r.last_stats["prefill_tokens"] == len(p)  # one prefill for all six


def test_no_decode_step_past_every_budget():
    """6 new tokens: prefill draws the first, so 5 decode steps, not two rounds of sync_every=4."""
    r = rollout(tiny("dense"), engine_kwargs={"hf": {"sync_every": 4}})
    outs = r.generate([GenerationRequest(p) for p in prompts([5, 8])], SamplingParams(temperature=1.0, max_tokens=6))
    assert [len(o[0].token_ids) for o in outs] == [6, 6]
    assert r.last_stats["decode_steps"] == 5


def test_continuous_batching_equals_one_by_one():
    model = tiny("dense")
    stop = [40, 41, 42, 43, 44, 45]  # frequent enough to end sequences at different lengths
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=16, stop_token_ids=stop)
    ps = prompts([5, 9, 3, 12, 7, 4, 10])
    reqs = [GenerationRequest(p) for p in ps]
    r = rollout(model, max_num_seqs=3)
    batched = r.generate(reqs, params)
    assert r.last_stats["prefills"] > 1  # slots were refilled while others ran
    lengths = {len(o[0].token_ids) for o in batched}
    assert len(lengths) > 1 and any(o[0].finish_reason == "stop" for o in batched)
    for req, o in zip(reqs, batched):
        alone = rollout(model).generate([req], params)[0][0]
        assert alone.token_ids == o[0].token_ids
        assert alone.finish_reason == o[0].finish_reason
        # other prompts in the packed prefill change the chunking, hence float rounding (not tokens)
        torch.testing.assert_close(torch.tensor(alone.log_probs), torch.tensor(o[0].log_probs), rtol=1e-4, atol=1e-5)


def test_stop_token_ends_sequence_and_is_kept():
    model = tiny("dense")
    p = prompts([6])[0]
    free = rollout(model).generate([GenerationRequest(p)], SamplingParams(temperature=0.0, max_tokens=10))[0][0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = rollout(model).generate([GenerationRequest(p)], SamplingParams(temperature=0.0, max_tokens=10,
                                                                        stop_token_ids=[stop_at]))[0][0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_log_probs_match_trainer_recomputation(kind):
    """Rollout log-probs (after temperature) equal the packed training forward's, fp32, to 1e-5."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    # The default init: the wide one gives logits in the hundreds, where fp32 rounding alone exceeds 1e-5.
    model = tiny(kind, init=0.02)
    temperature = 0.7
    ps = prompts([5, 9, 7], seed=4)
    outs = rollout(model, max_num_seqs=2).generate([GenerationRequest(p) for p in ps],
                                                   SamplingParams(temperature=temperature, seed=0, max_tokens=9))
    import copy

    trainer = copy.deepcopy(model)
    apply_monkey_patch(trainer, use_remove_padding=True)
    seqs = [p + o[0].token_ids for p, o in zip(ps, outs)]
    ids = torch.tensor([sum(seqs, [])])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        logits = trainer(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = 0
    for p, s, o in zip(ps, seqs, outs):
        n = len(o[0].token_ids)
        rows = torch.arange(start + len(p) - 1, start + len(p) - 1 + n)
        ref = logp[rows, torch.tensor(o[0].token_ids)]
        torch.testing.assert_close(torch.tensor(o[0].log_probs), ref, rtol=0, atol=1e-5)
        start += len(s)


def test_sampler_top_k_top_p_and_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g) * 2
    n = 20000
    keys = torch.arange(n) * 7919 % (2**31 - 1)
    steps = torch.zeros(n, dtype=torch.long)
    rep = logits.expand(n, -1)
    tok, lp = sample_tokens(rep, SamplerConfig(temperature=1.0), keys, steps)
    freq = torch.bincount(tok, minlength=50).float() / n
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.02
    torch.testing.assert_close(lp, torch.log_softmax(logits[0], -1)[tok])
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    tok_k, _ = sample_tokens(rep, SamplerConfig(temperature=1.0, top_k=3), keys, steps)
    assert set(tok_k.tolist()) == top3
    tok_p, _ = sample_tokens(rep, SamplerConfig(temperature=1.0, top_p=1e-6), keys, steps)
    assert set(tok_p.tolist()) == {int(logits[0].argmax())}
    sup = torch.tensor([int(logits[0].argmax())])
    tok_g, _ = sample_tokens(rep[:2], SamplerConfig(temperature=0.0), keys[:2], steps[:2], sup)
    assert int(tok_g[0]) == int(torch.topk(logits[0], 2).indices[1])
    u = counter_uniform(keys, steps)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


def test_unknown_engine_kwargs_are_refused():
    model = tiny("dense")
    r = rollout(model, engine_kwargs={"hf": {"bogus": 1}})
    with pytest.raises(ValueError, match="bogus"):
        r.generate([GenerationRequest([40, 41])], SamplingParams(max_tokens=2))


@pytest.fixture
def gloo_group():
    from tests.engine_utils import single_rank_gloo

    with single_rank_gloo():
        yield


def test_fsdp2_module_gathers_once_and_reshards(gloo_group):
    """Under FSDP2 the loop runs on parameters gathered for the whole call and leaves them sharded again."""
    import copy

    from torch.distributed.tensor import DTensor

    from verl.utils.fsdp_utils import apply_fsdp2, create_device_mesh

    model = tiny("dense")
    ps = prompts([6, 10, 4])
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=8)
    plain = rollout(model, max_num_seqs=2).generate([GenerationRequest(p) for p in ps], params)
    sharded = apply_fsdp2(copy.deepcopy(model), create_device_mesh(1, -1, "cpu"), None)
    outs = rollout(sharded, max_num_seqs=2).generate([GenerationRequest(p) for p in ps], params)
    assert [o[0].token_ids for o in outs] == [o[0].token_ids for o in plain]
    assert all(isinstance(p, DTensor) for p in sharded.parameters())  # resharded after the rollout
    with torch.no_grad():  # and the training forward still runs through FSDP's hooks
        sharded(input_ids=torch.tensor([ps[0]]), use_cache=False)


def test_lora_adapter_is_applied():
    """A PEFT-wrapped actor decodes through its LoRA layers (same tokens as the merged model)."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = tiny("dense")
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                 init_lora_weights=False))
    ps = prompts([6, 9])
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = rollout(peft_model).generate([GenerationRequest(p) for p in ps], params)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    for p, o in zip(ps, outs):
        assert o[0].token_ids == hf_greedy(merged, p, 8)
    plain = rollout(model).generate([GenerationRequest(p) for p in ps], params)
    assert [o[0].token_ids for o in outs] != [o[0].token_ids for o in plain]  # the adapter changed the output


@pytest.mark.parametrize("impl, dtype, syncs", [
    ("grouped_mm", torch.bfloat16, False), ("grouped_mm", torch.float32, True), ("batched_mm", torch.float32, False),
    ("eager", torch.bfloat16, True)])
def test_moe_runner_syncs_host_only_with_the_expert_loop(impl, dtype, syncs):
    """CUDA graphs for the MoE decode step hinge on this: transformers' eager experts loop over the experts hit
    (a host sync per layer); grouped_mm / batched_mm route on the device, but torch's grouped GEMM is fused for
    bf16 only (other dtypes take ATen's loop over the groups, which reads the offsets on the host: an H100 capture
    of fp32 experts failed with "Cannot copy between CPU and CUDA tensors during CUDA graph capture"). A dense
    model never syncs."""
    from verl.models.qwen3_5.hf_runner import Qwen35Runner

    model = build_tiny_qwen3_5(None, kind="moe", seed=0, with_tokenizer=False).to(dtype)
    model.set_experts_implementation(impl)
    assert Qwen35Runner(model).syncs_host is syncs
    assert Qwen35Runner(tiny("dense")).syncs_host is False


def test_moe_runner_with_lora_experts_counts_as_syncing():
    peft = pytest.importorskip("peft")
    from verl.models.qwen3_5.hf_runner import Qwen35Runner

    model = build_tiny_qwen3_5(None, kind="moe", seed=0, with_tokenizer=False)
    model.set_experts_implementation("grouped_mm")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert Qwen35Runner(lora).syncs_host is True


def test_moe_decode_is_the_same_under_each_expert_implementation():
    """The sync-free expert path the engine may graph-capture decodes the same tokens (and log-probs, fp32) as
    transformers' eager loop."""
    model = build_tiny_qwen3_5(None, kind="moe", seed=0, with_tokenizer=False, initializer_range=0.3)
    reqs = [GenerationRequest(p) for p in prompts([5, 17, 9, 3])]
    params = SamplingParams(temperature=1.0, top_k=40, seed=5, max_tokens=12, logprobs=True)
    outs = {}
    for impl in ("eager", "grouped_mm"):
        model.set_experts_implementation(impl)
        outs[impl] = rollout(model, max_num_seqs=2).generate(reqs, params)
    for a, b in zip(outs["eager"], outs["grouped_mm"]):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(torch.tensor(a[0].log_probs), torch.tensor(b[0].log_probs), rtol=1e-5, atol=1e-5)


def test_generation_hands_its_cache_back_to_the_device(monkeypatch):
    """After generating, the decode engine's KV cache is released to the driver (empty_cache), not kept in
    torch's allocator: the 9B actor update after a rollout ran out of memory in Triton's autotuning without it."""
    from verl.workers.rollout.hf_engine import entry

    calls = []
    monkeypatch.setattr(entry, "get_torch_device", lambda: SimpleNamespace(empty_cache=lambda: calls.append(1)))
    out = rollout(tiny("dense")).generate([GenerationRequest(p) for p in prompts([4, 6])],
                                          SamplingParams(temperature=1.0, seed=1, max_tokens=3))
    assert [len(o[0].token_ids) for o in out] == [3, 3] and calls == [1]


def test_engine_metrics_split_the_rollout_time():
    """Each generate call leaves the decode loop's split (seconds in all and prefilling, decode steps, slots,
    whether CUDA graphs ran) for the worker to log as perf/hf_engine/* (max over ranks)."""
    from verl.trainer.ppo.ray_trainer import _combine_agent_loop_metrics

    r = rollout(tiny("dense"), max_num_seqs=2)
    r.generate([GenerationRequest(p) for p in prompts([4, 6, 5])], SamplingParams(temperature=1.0, seed=1, max_tokens=5))
    m = r.engine_metrics
    assert m["perf/hf_engine/cuda_graphs"] == 0.0 and m["perf/hf_engine/slots"] == 2.0
    assert m["perf/hf_engine/prefill_tokens"] == 15.0 and m["perf/hf_engine/decode_steps"] >= 8  # 3 seqs, 2 slots
    assert 0 < m["perf/hf_engine/prefill_s"] < m["perf/hf_engine/run_s"]
    # the host's waits at its looks at finished sequences: part of the decode time, never more
    assert 0 < m["perf/hf_engine/device_wait_s"] < m["perf/hf_engine/run_s"] - m["perf/hf_engine/prefill_s"]
    slower = {**m, "perf/hf_engine/run_s": m["perf/hf_engine/run_s"] + 1}
    assert _combine_agent_loop_metrics([m, slower])["perf/hf_engine/run_s"] == slower["perf/hf_engine/run_s"]
