"""Server mode over gloo with a recording STAND-IN engine (tests.vllm_testing.RecordingEngine stands in for
vLLMRollout inside the spawned server; no vLLM needed): buckets, LoRA kept apart, errors, sleep/wake
forwarding, and how main_ppo's config selects server mode."""

import pytest
import torch
from omegaconf import OmegaConf

from verl.workers.rollout.base import GenerationRequest, SamplingParams
from verl.workers.rollout.vllm_rollout.server import vLLMServerClient


@pytest.fixture(scope="module")
def client():
    cfg = OmegaConf.create({"checkpoint_engine": {"update_weights_bucket_megabytes": 1}})
    c = vLLMServerClient(cfg, {"path": "unused"}, backend="gloo",
                         engine_cls="tests.vllm_testing.RecordingEngine", start_timeout=300)
    yield c
    c.shutdown()


def _counters(client):
    return client.generate([GenerationRequest([1])], SamplingParams())[0][0].token_ids


def test_server_engine_is_built_standalone(client):
    # standalone=True: the real engine then treats every full sync as a checkpoint-format reload
    # (post-load processing on vLLM-Ascend) instead of the colocated runtime-layout writes.
    assert _counters(client)[3] == 1


def test_full_update_streams_buckets_in_order(client):
    # ~3 MiB in 1 MiB buckets: several buckets, tensors arrive intact and in order.
    weights = [(f"w{i}", torch.full((256, 1024), float(i), dtype=torch.float32)) for i in range(3)]
    weights.append(("b", torch.arange(10, dtype=torch.bfloat16)))
    before = _counters(client)
    client.update_weights(iter(weights))
    assert client.score([[0]])[0] == [float(t.float().sum()) for _, t in weights]
    full, lora, received = _counters(client)[:3]
    assert (full, lora, received) == (before[0] + 1, before[1], before[2] + 4)


def test_lora_update_is_separate(client):
    before = _counters(client)
    a = torch.randn(4, 16)
    client.update_weights([("base_model.model.x.lora_A.weight", a)], lora={"peft_config": {}, "lora_int_id": 1})
    full, lora = _counters(client)[:2]
    assert (full, lora) == (before[0], before[1] + 1)  # the full-reload path (and its post-processing) not taken
    assert client.score([[0]])[0] == pytest.approx([float(a.sum())])


def test_server_errors_come_back_and_server_survives(client):
    with pytest.raises(RuntimeError, match="coverage check failed: fail.me"):
        client.update_weights([("fail.me", torch.ones(2))])
    assert _counters(client)[2] >= 1  # still serving


def test_sleep_and_wake_reach_the_server(client):
    before = _counters(client)
    client.sleep()
    client.wake_up(("weights",))
    client.wake_up(("kv_cache",))
    after = _counters(client)
    assert (after[4], after[5]) == (before[4] + 1, before[5] + 2)


def test_checkpoint_engine_backend_selects_server_mode():
    from verl.workers.rollout.vllm_rollout.engine_args import server_backend

    assert server_backend(OmegaConf.create({}), "cpu") is None  # naive by default: in-process engine
    assert server_backend(OmegaConf.create({"checkpoint_engine": {"backend": "naive"}}), "cuda") is None
    assert server_backend({"checkpoint_engine": {"backend": "gloo"}}, "cpu") == "gloo"
    assert server_backend({"checkpoint_engine": {"backend": "nccl"}}, "cuda") == "nccl"
    assert server_backend({"checkpoint_engine": {"backend": "hccl"}}, "npu") == "hccl"
    with pytest.raises(ValueError, match=r"checkpoint_engine\.backend=nccl needs a cuda device.*use hccl"):
        server_backend({"checkpoint_engine": {"backend": "nccl"}}, "npu")
    with pytest.raises(ValueError, match=r"checkpoint_engine\.backend='nixl' is not supported"):
        server_backend({"checkpoint_engine": {"backend": "nixl"}}, "cuda")
