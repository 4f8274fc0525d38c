"""Partial rollout in the decode session (hf_engine.session): pause between decode steps, new weights in place,
resume with the live sequences' prefixes re-prefilled; tiny fp32, CPU."""

import copy
import time

import pytest
import torch

from tests.workers.rollout.test_hf_engine import prompts, rollout, tiny
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
from verl.workers.rollout.base import GenerationRequest, SamplingParams
from verl.workers.rollout.hf_engine.entry import build_sequences, open_engine
from verl.workers.rollout.hf_engine.session import EngineSession
from verl.workers.weight_sync.receive import load_hf_weights

STOP = [40, 41, 42, 43, 44, 45]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


class PausingSession(EngineSession):
    """Parks itself after the rounds in ``at`` (deterministic pause points; ``pause()`` from the caller's thread
    parks at whichever round boundary comes next). ``wait_parked`` returns once it is parked."""

    def __init__(self, *args, at=(), **kwargs):
        self.at, self.rounds = set(at), 0
        super().__init__(*args, **kwargs)

    def _step(self, *args):
        super()._step(*args)
        self.rounds += 1
        if self.rounds in self.at:
            with self._cond:
                self._pause = True

    def wait_parked(self):
        with self._cond:
            while not self._parked and self._error is None:
                self._cond.wait()


def run_paused(r, chunks, params, capacity=4, at=(), swaps=None, max_len=64):
    """On rollout ``r``: submit the chunks to a session, resume at each pause point (``swaps[k]()`` first: the
    weight install) as versions 1, 2, ..., collect; (results per chunk, stats per chunk)."""
    with open_engine(r, params) as engine:
        session = PausingSession(engine, capacity=capacity, max_len=max_len, max_new=params.max_tokens, at=at)
        try:
            for k, reqs in enumerate(chunks):
                session.submit(k, build_sequences(reqs, params, r.module.config, params.seed)[0])
            for version in range(1, len(at) + 1):
                session.wait_parked()
                if swaps:
                    swaps[version - 1]()
                session.resume(version)
            got = [session.collect(k) for k in range(len(chunks))]
        finally:
            session.close()
    return [res for res, _ in got], [st for _, st in got]


def _run(model, chunks, params, **kw):
    return run_paused(rollout(model, max_num_seqs=4), chunks, params, **kw)


def _chunks(seed=0):
    return [[GenerationRequest(p) for p in prompts(lengths, seed=seed + s)]
            for s, lengths in enumerate(([5, 9, 3], [12, 7, 4]))]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=STOP, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=14, stop_token_ids=STOP, seed=5),
], ids=["greedy", "sampled"])
def test_pause_and_resume_with_the_same_weights_is_token_identical(params):
    """Two pauses with a version bump but the same weights: the live sequences' prefixes are re-prefilled, and
    every response equals the uninterrupted session's token for token (log-probs to fp32 rounding)."""
    model = tiny("dense")
    chunks = _chunks()
    plain, _ = _run(model, chunks, params)
    paused, stats = _run(model, chunks, params, at=(1, 3))
    assert sum(st["pauses"] for st in stats) == 2
    assert sum(st["reprefills"] for st in stats) > 0  # the pauses caught live sequences
    split = 0
    for a, b in zip(sum(plain, []), sum(paused, [])):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(b.log_probs), torch.tensor(a.log_probs), rtol=1e-4, atol=1e-5)
        assert a.versions == [(0, 0)]
        starts = [s for s, _ in b.versions]
        assert starts == sorted(starts) and [v for _, v in b.versions] == sorted(v for _, v in b.versions)
        split += len(b.versions) > 1
    assert split  # some responses span versions


@pytest.mark.parametrize("wrap", ["plain", "fsdp2"])
def test_tokens_after_new_weights_carry_their_version_and_log_probs(wrap, request):
    """New weights installed mid-generation (load_hf_weights while the session holds the module, gathered under
    FSDP2): each token's recorded log-prob equals a full recompute under the weights of the version it carries,
    and after the session the module (its shards, under FSDP2) holds the new weights."""
    old = tiny("dense", init=0.02)  # the default init: recomputes agree to fp32 rounding (see test_hf_engine)
    new = build_tiny_qwen3_5(None, kind="dense", seed=1, with_tokenizer=False, initializer_range=0.02)
    model = copy.deepcopy(old)
    if wrap == "fsdp2":
        request.getfixturevalue("gloo")
        from verl.utils.fsdp_utils import apply_fsdp2, create_device_mesh

        model = apply_fsdp2(model, create_device_mesh(1, -1, "cpu"), None)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    chunks = _chunks(seed=7)
    before = dict(old.named_parameters())  # (model starts as a copy of old)

    def install():
        load_hf_weights(model, list(new.named_parameters()))

    got, stats = _run(model, chunks, params, at=(1,), swaps=[install])
    assert sum(st["reprefills"] for st in stats) > 0
    seqs = [(req.prompt_token_ids, res) for reqs, results in zip(chunks, got) for req, res in zip(reqs, results)]
    mixed = 0
    for prompt, res in seqs:
        ids = torch.tensor([list(prompt) + res.tokens])
        with torch.no_grad():
            lp = {v: torch.log_softmax(m(input_ids=ids, use_cache=False).logits[0].float(), -1)
                  for v, m in ((0, old), (1, new))}
        per_token = [0] * len(res.tokens)
        for start, version in res.versions:
            per_token[start:] = [version] * (len(res.tokens) - start)
        rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(res.tokens))
        tok = torch.tensor(res.tokens)
        ref = torch.stack([lp[v][r, t] for v, r, t in zip(per_token, rows, tok)])
        other = torch.stack([lp[1 - v][r, t] for v, r, t in zip(per_token, rows, tok)])
        torch.testing.assert_close(torch.tensor(res.log_probs), ref, rtol=0, atol=2e-5)
        assert (torch.tensor(res.log_probs) - other).abs().max() > 1e-3  # the check tells the versions apart
        mixed += 0 in per_token and 1 in per_token
    assert mixed  # responses that were live at the pause: old tokens, then new ones
    # after the session: the module holds the new weights (FSDP2: the gathered copy went, the shards hold them)
    changed = 0
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full, dict(new.named_parameters())[name], rtol=0, atol=0)
        changed += not torch.equal(full, before[name])
    assert changed > len(before) // 2  # (norm weights start at one in both models)


def test_pause_from_the_callers_thread_keeps_the_output():
    """The public pause()/resume() from another thread while chunks decode, many times: same tokens."""
    model = tiny("dense")
    params = SamplingParams(temperature=1.0, max_tokens=14, stop_token_ids=STOP, seed=5)
    chunks = _chunks()
    plain, _ = _run(model, chunks, params)
    r = rollout(model, max_num_seqs=4)
    with open_engine(r, params) as engine:
        session = EngineSession(engine, capacity=4, max_len=64, max_new=params.max_tokens)
        try:
            for k, reqs in enumerate(chunks):
                session.submit(k, build_sequences(reqs, params, model.config, params.seed)[0])
            version = 0
            while not session.ready(len(chunks) - 1):
                session.pause()
                version += 1
                session.resume(version)
                time.sleep(0.003)  # (a pause right after a resume would keep it parked: let a round run)
            got = [session.collect(k)[0] for k in range(len(chunks))]
        finally:
            session.close()
    assert [x.tokens for x in sum(got, [])] == [x.tokens for x in sum(plain, [])]


def test_pipeline_swap_stamps_each_token_with_its_version():
    """The worker's pipeline: weights swapped (the same ones, as version 1) while chunk 0 is in flight, chunk 1
    submitted after: the responses equal an uninterrupted pipeline's, chunk 1's tokens are all version 1, chunk
    0's rows go 0 ... then 1, and padding carries 0."""
    from omegaconf import OmegaConf

    from tests.workers.rollout.test_hf_engine import VOCAB
    from tests.workers.rollout.test_hf_engine_session import _prompt_batch
    from verl.workers.rollout.pipelined import ChunkPipeline

    model = tiny("dense")
    cfg = OmegaConf.create({"enforce_eager": True, "max_num_seqs": 8, "temperature": 1.0, "top_p": 1.0,
                            "top_k": -1, "response_length": 10, "prompt_length": 16, "do_sample": True})
    r = rollout(model, **cfg)
    eos = [VOCAB["<|im_end|>"]] + STOP
    batches = [_prompt_batch(prompts(lengths, seed=s)) for s, lengths in enumerate(([5, 9, 6], [7, 3]))]

    def run(swap: bool):
        torch.manual_seed(7)
        pipe = ChunkPipeline(r, cfg, eos, 0)
        pipe.submit(0, batches[0], depth=2, version=0)
        if swap:
            pipe.swap_weights(lambda: None, 1)
        pipe.submit(1, batches[1], depth=2, version=1 if swap else 0)
        return [pipe.collect(0), pipe.collect(1)]

    plain, swapped = run(False), run(True)
    for a, b in zip(plain, swapped):
        assert torch.equal(a.batch["responses"], b.batch["responses"])
        torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], rtol=1e-4, atol=1e-5)
        assert torch.equal(a.batch["rollout_weight_version"], torch.zeros_like(a.batch["response_mask"]))
    v0, v1 = (b.batch["rollout_weight_version"] for b in swapped)
    mask0, mask1 = (b.batch["response_mask"].bool() for b in swapped)
    assert torch.equal(v1, mask1.long())  # submitted after the swap: version 1 throughout, 0 on padding
    assert (v0[~mask0] == 0).all() and (v0.diff(dim=-1)[:, :][mask0[:, 1:]] >= 0).all()
    with pytest.raises(RuntimeError, match="swap_weights"):  # a version change outside swap_weights
        pipe = ChunkPipeline(r, cfg, eos, 0)
        pipe.submit(0, batches[0], depth=2, version=0)
        try:
            pipe.submit(1, batches[1], depth=2, version=1)
        finally:
            pipe.collect(0)
