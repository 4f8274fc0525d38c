"""Colocated vLLM through the worker's cycle: sleep after generating, wake weights -> sync -> wake KV cache.

vLLM's sleep mode is CUDA-only, so the CPU build cannot free memory. Here the real engine runs generation
and the weight sync; only ``LLM.sleep`` / ``LLM.wake_up`` are replaced by a recording STAND-IN (standing in
for vLLM's CUDA sleep mode), to check what ``vLLMRollout`` asks of vLLM and in which order relative to the
sync. On CUDA the same calls reach vLLM itself (gpu suite).
"""

import gc

import pytest
import torch

from tests.vllm_testing import build_engine_checkpoint, model_config, rollout_config, sgd_step, trainer_logprobs

pytestmark = pytest.mark.vllm

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    path = tmp_path_factory.mktemp("m")
    hf = build_engine_checkpoint(path, "dense")
    rollout = vLLMRollout(rollout_config(free_cache_engine=True, enable_sleep_mode=True), model_config(path),
                          tokenizer=None)
    yield rollout, hf
    rollout.shutdown()
    gc.collect()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU build behaviour (CUDA sleeps: test_vllm_cuda_gpu.py)")
def test_cpu_build_sleep_is_a_logged_no_op(engine):
    rollout, _ = engine
    assert rollout.free_cache_engine and not rollout.sleeps  # no sleep mode on CPU: nothing to release
    rollout.sleep()
    assert not rollout.is_sleeping
    assert len(rollout.score([SEQ])[0]) == len(SEQ) - 1  # still serving


def test_worker_cycle_order_with_sleep_mode(engine, monkeypatch):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams
    from verl.workers.weight_sync import iter_hf_weights
    from verl.workers.weight_sync.cycle import RolloutCycle

    rollout, hf = engine
    events = []
    monkeypatch.setattr(rollout, "_sleep_supported", True)  # as on CUDA
    monkeypatch.setattr(rollout.llm, "sleep", lambda level: events.append(("llm.sleep", level)))
    monkeypatch.setattr(rollout.llm, "wake_up", lambda tags: events.append(("llm.wake_up", tuple(tags))))
    real_generate = rollout.generate

    def generate(*a, **k):
        assert not rollout.is_sleeping, "generation must run on a fully awake engine"
        events.append(("generate",))
        return real_generate(*a, **k)

    monkeypatch.setattr(rollout, "generate", generate)

    def sync():
        events.append(("sync",))
        rollout.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))

    cycle = RolloutCycle(rollout, sync)
    for step in range(2):
        cycle.before_generate()
        rollout.generate([GenerationRequest([5, 6, 7])], SamplingParams(max_tokens=2))
        cycle.after_generate()  # before the log-prob passes and the actor update
        assert rollout.is_sleeping
        sgd_step(hf, SEQ, lr=0.3)
        cycle.weights_changed()
    first = [("sync",), ("generate",), ("llm.sleep", 2)]  # a new engine starts awake
    later = [("llm.wake_up", ("weights",)), ("sync",), ("llm.wake_up", ("kv_cache",)), ("generate",),
             ("llm.sleep", 2)]  # level 2: full-weight sync follows every wake-up
    assert events == first + later, events
    # The next generation syncs the latest step first: the engine then scores like the trainer.
    cycle.before_generate()
    assert (torch.tensor(rollout.score([SEQ])[0]) - trainer_logprobs(hf, SEQ)).abs().max().item() < 0.1
