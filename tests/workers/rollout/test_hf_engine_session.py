"""A decode session spanning chunks (hf_engine.session) and the worker-side pipeline over it, tiny fp32, CPU."""

import pytest
import torch

from tests.workers.rollout.test_hf_engine import VOCAB, prompts, rollout, tiny
from verl.protocol import DataProto
from verl.workers.rollout.base import GenerationRequest, SamplingParams
from verl.workers.rollout.hf_engine.entry import build_sequences, open_engine
from verl.workers.rollout.hf_engine.session import EngineSession

STOP = [40, 41, 42, 43, 44, 45]  # frequent enough to end sequences at different lengths


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=STOP, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=14, stop_token_ids=STOP, seed=5),
], ids=["greedy", "sampled"])
def test_session_merges_chunks_and_matches_each_chunk_alone(params):
    model = tiny("dense")
    r = rollout(model, max_num_seqs=4)
    chunks = [[GenerationRequest(p) for p in prompts(lengths, seed=s)]
              for s, lengths in enumerate(([5, 9, 3], [12, 7, 4], [10, 6]))]
    alone, steps_alone = [], 0
    for reqs in chunks:
        alone.append(r.generate(reqs, params))
        steps_alone += r.last_stats["decode_steps"]
    with open_engine(r, params) as engine:
        session = EngineSession(engine, capacity=4, max_len=40, max_new=params.max_tokens)
        try:
            seqs = [build_sequences(reqs, params, model.config, params.seed)[0] for reqs in chunks]
            for k, s in enumerate(seqs):
                session.submit(k, s)
            got, stats = [], []
            for k in range(len(chunks)):
                res, st = session.collect(k)
                got.append(res)
                stats.append(st)
            assert session.pending() == 0
        finally:
            session.close()
    for k, reqs in enumerate(chunks):
        for res, out in zip(got[k], alone[k]):
            assert res.tokens == out[0].token_ids  # token for token, whatever shared the batch
            assert res.finish_reason == out[0].finish_reason
            torch.testing.assert_close(torch.tensor(res.log_probs), torch.tensor(out[0].log_probs),
                                       rtol=1e-4, atol=1e-5)
    assert len({len(res.tokens) for res in sum(got, [])}) > 1  # the chunks have tails to overlap
    # One running batch across the chunks: fewer decode steps than the chunks one after another, and every
    # collect reports only the steps since the previous one.
    total = sum(st["decode_steps"] for st in stats)
    assert total < steps_alone, (total, steps_alone)
    assert all(st["slots"] == 4 for st in stats)
    assert sum(st["slot_steps"] for st in stats) <= total * 4


def test_session_rebuilds_its_cache_for_a_longer_chunk():
    model = tiny("dense")
    r = rollout(model)
    params = SamplingParams(temperature=0.0, max_tokens=6, seed=0)
    short, long_ = [GenerationRequest(p) for p in prompts([4, 5])], [GenerationRequest(p) for p in prompts([20])]
    with open_engine(r, params) as engine:
        session = EngineSession(engine, capacity=4, max_len=12, max_new=6)
        try:
            session.submit("a", build_sequences(short, params, model.config, 0)[0])
            session.submit("b", build_sequences(long_, params, model.config, 0)[0])
            a, _ = session.collect("a")
            b, _ = session.collect("b")
        finally:
            session.close()
    assert [x.tokens for x in a] == [o[0].token_ids for o in r.generate(short, params)]
    assert b[0].tokens == r.generate(long_, params)[0][0].token_ids


def _prompt_batch(lists, pad=0):
    width = max(len(p) for p in lists)
    ids = torch.full((len(lists), width), pad)
    mask = torch.zeros((len(lists), width), dtype=torch.long)
    for i, p in enumerate(lists):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos})


def test_pipeline_submit_ahead_then_collect_equals_generate_sequences():
    """The worker's pipeline: chunk 2 submitted before chunk 1 is collected; each chunk's batch equals
    generate_sequences on it, with the seed drawn from the global RNG in submission order."""
    from omegaconf import OmegaConf

    from verl.workers.rollout.batching import generate_sequences
    from verl.workers.rollout.pipelined import ChunkPipeline, supports_pipelining

    model = tiny("dense")
    cfg = OmegaConf.create({"enforce_eager": True, "max_num_seqs": 8, "temperature": 1.0, "top_p": 1.0,
                            "top_k": -1, "response_length": 10, "prompt_length": 16, "do_sample": True})
    r = rollout(model, **cfg)
    assert supports_pipelining(r)
    eos = [VOCAB["<|im_end|>"]] + STOP
    batches = [_prompt_batch(prompts(lengths, seed=s)) for s, lengths in enumerate(([5, 9], [7, 3], [11, 4]))]
    torch.manual_seed(7)
    expected = [generate_sequences(r, b, cfg, eos, 0) for b in batches]
    rng_after = torch.get_rng_state()
    torch.manual_seed(7)
    pipe = ChunkPipeline(r, cfg, eos, 0)
    pipe.submit(0, batches[0], depth=2)
    pipe.submit(1, batches[1], depth=2)
    got = [pipe.collect(0)]
    pipe.submit(2, batches[2], depth=2)
    got += [pipe.collect(1), pipe.collect(2)]
    assert pipe.pending() == 0 and pipe._session is None  # the session closes with its last chunk
    assert torch.equal(torch.get_rng_state(), rng_after)
    for e, g in zip(expected, got):
        assert torch.equal(e.batch["responses"], g.batch["responses"])
        assert torch.equal(e.batch["attention_mask"], g.batch["attention_mask"])
        torch.testing.assert_close(e.batch["rollout_log_probs"], g.batch["rollout_log_probs"], rtol=1e-4, atol=1e-5)
    assert "perf/hf_engine/decode_steps" in r.engine_metrics
