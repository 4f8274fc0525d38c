"""vLLM engine end to end on CPU: generation, weight sync proven by log-probs, coverage failure by name.

Run with ``bash scripts/run_vllm_tests.sh`` (needs the .venv-vllm test environment).
"""

import gc

import pytest
import torch

pytestmark = pytest.mark.vllm

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module", params=["dense", "moe"])
def engine(request, tmp_path_factory):
    from tests.vllm_testing import build_engine_checkpoint, model_config, rollout_config
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    path = tmp_path_factory.mktemp(request.param)
    hf = build_engine_checkpoint(path, request.param)
    rollout = vLLMRollout(rollout_config(), model_config(path), tokenizer=None)
    yield request.param, rollout, hf
    rollout.shutdown()  # vLLM's parallel state is process-global: free it for the next engine
    gc.collect()


def test_generate_returns_ids_logprobs_and_stop(engine):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    _, rollout, _ = engine
    reqs = [GenerationRequest([5, 6, 7]), GenerationRequest([8, 9, 10, 11])]
    out = rollout.generate(reqs, SamplingParams(n=2, max_tokens=6, seed=3, top_k=0))
    assert len(out) == 2 and all(len(o) == 2 for o in out)
    for sample in (s for o in out for s in o):
        assert len(sample.token_ids) == 6 and len(sample.log_probs) == 6
        assert all(lp <= 0.0 for lp in sample.log_probs)
        assert sample.finish_reason == "length"
    # A stop id ends the sample with it included (same contract as the HF engine).
    first = out[0][0].token_ids
    greedy = rollout.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=6))[0][0]
    stop = rollout.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[greedy.token_ids[2]]))
    s = stop[0][0]
    assert s.finish_reason == "stop" and s.token_ids == greedy.token_ids[: len(s.token_ids)]
    assert s.token_ids[-1] == greedy.token_ids[2]
    assert first  # sampled output is non-empty


def test_sync_after_optimizer_step_reaches_engine(engine):
    from tests.vllm_testing import sgd_step, trainer_logprobs
    from verl.workers.weight_sync import iter_hf_weights

    kind, rollout, hf = engine
    engine_before = torch.tensor(rollout.score([SEQ])[0])
    trainer_before = trainer_logprobs(hf, SEQ)
    torch.testing.assert_close(engine_before, trainer_before, atol=0.05, rtol=0)  # bf16 engine vs fp32 trainer

    sgd_step(hf, SEQ, lr=0.3)
    trainer_after = trainer_logprobs(hf, SEQ)
    moved = (trainer_after - trainer_before).abs().max().item()
    assert moved > 0.5  # the step changed the model measurably

    rollout.update_weights(iter_hf_weights(hf, bucket_megabytes=rollout.bucket_megabytes, dtype=torch.bfloat16))
    engine_after = torch.tensor(rollout.score([SEQ])[0])
    assert (engine_after - engine_before).abs().max().item() > 0.5  # new weights arrived
    # ...and they are the trainer's: the gap to the trainer is small next to how far the step moved it.
    assert (engine_after - trainer_after).abs().max().item() < 0.25 * moved


def test_layered_sync_is_equivalent(engine):
    from verl.workers.weight_sync import iter_hf_weights

    _, rollout, hf = engine
    before = rollout.score([SEQ])[0]
    rollout.update_weights(iter_hf_weights(hf, layered=True, dtype=torch.bfloat16))
    assert rollout.score([SEQ])[0] == pytest.approx(before, abs=1e-4)


def test_missing_parameter_fails_coverage_by_name(engine):
    from verl.workers.weight_sync import WeightCoverageError, iter_hf_weights

    _, rollout, hf = engine
    dropped = "model.layers.2.post_attention_layernorm.weight"
    partial = ((n, t) for n, t in iter_hf_weights(hf, dtype=torch.bfloat16) if n != dropped)
    with pytest.raises(WeightCoverageError, match=dropped.replace(".", r"\.")):
        rollout.update_weights(partial)
    rollout.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))  # a complete sync passes again


def test_engine_names_match_the_mapping(engine):
    from verl.workers.weight_sync import expected_engine_names

    _, rollout, hf = engine
    # The HF->engine rules in weight_sync.names predict exactly the engine's parameters.
    assert expected_engine_names((n for n, _ in hf.named_parameters()), rollout.layout) == rollout._engine_names


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU build behaviour (CUDA sleeps: test_vllm_cuda_gpu.py)")
def test_sleep_is_a_noop_on_cpu(engine):
    _, rollout, _ = engine
    rollout.sleep()
    rollout.wake_up()
    assert not rollout.is_sleeping and rollout.score([SEQ[:4]])


def test_routing_replay_on_an_engine_that_cannot_record_is_refused_by_name(tmp_path):
    """R3 asks vLLM for the routed experts (enable_return_routed_experts). vLLM 0.32's CPU build cannot record them
    (its recorder needs Model Runner V2, which needs Triton): the engine start fails with the rollout key named.
    On CUDA the routes themselves are checked by test_vllm_cuda_gpu.py::test_routed_experts_match_the_trainers_router."""
    from tests.vllm_testing import build_engine_checkpoint, model_config, rollout_config
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    if torch.cuda.is_available():
        pytest.skip("CUDA vLLM records routes: see test_vllm_cuda_gpu.py")
    build_engine_checkpoint(tmp_path / "m", "moe")
    with pytest.raises(RuntimeError, match="enable_rollout_routing_replay=true asks vLLM to return the routed experts"):
        vLLMRollout(rollout_config(enable_rollout_routing_replay=True), model_config(tmp_path / "m"), tokenizer=None)
    gc.collect()
