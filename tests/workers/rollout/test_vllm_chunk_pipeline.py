"""vLLM's chunk pipeline (the asynchronous modes' rollout pool with ``rollout.name=vllm``), on the CPU build (and
on CUDA through scripts/gpu_vllm.sh, CUDA graphs on; not run there yet):
chunks in flight share the engine and each equals ``generate`` on its own; a weight swap mid-flight continues
every unfinished response with the new weights from where it stopped, each token stamped with its version.

Run with ``bash scripts/run_vllm_tests.sh`` (needs the .venv-vllm test environment).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from tests.workers.rollout.test_hf_engine_session import _prompt_batch

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
MAX = 24


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.vllm_testing import build_engine_checkpoint, model_config, rollout_config
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    path = tmp_path_factory.mktemp("dense")
    # untied LM head: the tied tiny model's greedy choice is the last token again, whatever its weights
    hf = build_engine_checkpoint(path, "dense", tie_word_embeddings=False)
    # On CUDA with graphs on: the pipeline's thread replays the graphs vLLM captured on the main thread.
    cfg = rollout_config(response_length=MAX, max_num_seqs=8, enforce_eager=not torch.cuda.is_available())
    rollout = vLLMRollout(cfg, model_config(path), tokenizer=None)
    yield rollout, hf
    rollout.shutdown()
    gc.collect()


def _cfg(**kw):
    from omegaconf import OmegaConf

    # greedy and no stop ids: every response runs MAX tokens, so a swap always finds them unfinished
    base = dict(temperature=0.0, top_p=1.0, top_k=-1, response_length=MAX, prompt_length=8, do_sample=False,
                ignore_eos=True, calculate_log_probs=True)
    base.update(kw)
    return OmegaConf.create(base)


def _greedy(rollout, prompt, n):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n)
    return rollout.generate([GenerationRequest(list(prompt))], params)[0][0].token_ids


def test_chunks_in_flight_each_equal_generate(engine):
    from verl.workers.rollout.pipelined import supports_pipelining
    from verl.workers.rollout.vllm_rollout.pipeline import VLLMChunkPipeline

    rollout, _ = engine
    assert supports_pipelining(rollout) and rollout.chunk_pipeline_class is VLLMChunkPipeline
    pipe = VLLMChunkPipeline(rollout, _cfg(), eos_ids=[], pad_token_id=0)
    pipe.submit("a", _prompt_batch(PROMPTS[:2]), depth=2, version=3)
    pipe.submit("b", _prompt_batch(PROMPTS[2:]), depth=2, version=3)
    assert pipe.pending() == 2
    # each collect reports the engine's work since the previous one (a plain generate resets them)
    got, steps = {}, 0
    for tag in ("a", "b"):
        got[tag] = pipe.collect(tag)
        steps += rollout.engine_metrics["perf/vllm/steps"]
        assert rollout.engine_metrics["perf/vllm/pauses"] == 0
    assert pipe.pending() == 0
    for tag, rows in (("a", PROMPTS[:2]), ("b", PROMPTS[2:])):
        out = got[tag]
        for i, prompt in enumerate(rows):
            assert out.batch["responses"][i].tolist() == _greedy(rollout, prompt, MAX)
        # rollout.ignore_eos: no stop ids, so vLLM stops at none (not even its checkpoint's EOS)
        assert bool(out.batch["response_mask"].bool().all())
        assert bool((out.batch["rollout_weight_version"] == 3).all())
        lp = out.batch["rollout_log_probs"]
        assert bool((lp <= 0).all()) and bool((lp < 0).any())
    assert steps >= MAX  # one token per request per step at most
    # the stepping thread stopped with the last chunk: plain generate has the engine again
    assert len(_greedy(rollout, PROMPTS[0], 4)) == 4


def test_weights_swapped_mid_flight_continue_each_response_with_the_new_ones(engine, tmp_path):
    from tests.vllm_testing import build_engine_checkpoint
    from verl.workers.rollout.vllm_rollout.pipeline import VLLMChunkPipeline
    from verl.workers.weight_sync import iter_hf_weights

    rollout, hf = engine
    other = build_engine_checkpoint(tmp_path / "other", "dense", seed=1, tie_word_embeddings=False)
    old = {tuple(p): _greedy(rollout, p, MAX) for p in PROMPTS}
    pipe = VLLMChunkPipeline(rollout, _cfg(), eos_ids=[], pad_token_id=0)
    pipe.submit(0, _prompt_batch(PROMPTS), depth=1, version=0)
    rows = pipe._chunks[0].rows
    deadline = time.monotonic() + 120
    while not any(2 <= len(r.tokens) < MAX // 2 for r in rows):  # some response is part-way through
        assert time.monotonic() < deadline and pipe.pending() and not pipe.ready(0)
        time.sleep(0.001)
    state = {}

    def install():  # another random model of the same shape: every greedy continuation moves
        state["cut"] = [len(r.tokens) for r in rows]
        rollout.update_weights(iter_hf_weights(other, dtype=torch.bfloat16))

    pipe.swap_weights(install, version=1)
    out = pipe.collect(0)
    metrics = rollout.engine_metrics
    assert metrics["perf/vllm/pauses"] == 1
    assert metrics["perf/vllm/reprefills"] == sum(c < MAX for c in state["cut"])
    moved = 0
    for i, (prompt, cut) in enumerate(zip(PROMPTS, state["cut"])):
        tokens = out.batch["responses"][i].tolist()
        versions = out.batch["rollout_weight_version"][i].tolist()
        assert tokens[:cut] == old[tuple(prompt)][:cut]  # sampled before the swap, with the old weights
        # ...and from the cut on, what the new weights continue prompt + those tokens with (a fresh prefill:
        # no KV cache of the old weights)
        if cut < MAX:
            assert tokens[cut:] == _greedy(rollout, prompt + tokens[:cut], MAX - cut)
        assert versions == [0] * cut + [1] * (MAX - cut)
        moved += tokens[cut:] != old[tuple(prompt)][cut:]
    assert moved  # the new weights changed some continuation, so the check above tells the versions apart
    rollout.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))  # the fixture's weights back
