"""Server mode over gloo with a stand-in engine in a spawned process (no vLLM): buckets, LoRA kept apart."""

import pytest
import torch
from omegaconf import OmegaConf

from verl.workers.rollout.base import GenerationRequest, SamplingParams
from verl.workers.rollout.vllm_rollout.server import vLLMServerClient


@pytest.fixture(scope="module")
def client():
    cfg = OmegaConf.create({"checkpoint_engine": {"update_weights_bucket_megabytes": 1}})
    c = vLLMServerClient(cfg, {"path": "unused"}, backend="gloo",
                         engine_cls="verl.workers.rollout.vllm_rollout.testing.RecordingEngine", start_timeout=300)
    yield c
    c.shutdown()


def _counters(client):
    return client.generate([GenerationRequest([1])], SamplingParams())[0][0].token_ids


def test_full_update_streams_buckets_in_order(client):
    # ~3 MiB in 1 MiB buckets: several buckets, tensors arrive intact and in order.
    weights = [(f"w{i}", torch.full((256, 1024), float(i), dtype=torch.float32)) for i in range(3)]
    weights.append(("b", torch.arange(10, dtype=torch.bfloat16)))
    client.update_weights(iter(weights))
    assert client.score([[0]])[0] == [float(t.float().sum()) for _, t in weights]
    full, lora, post, received = _counters(client)
    assert (full, lora, post, received) == (1, 0, 1, 4)  # full reload post-processes once


def test_lora_update_is_separate_and_not_post_processed(client):
    before = _counters(client)
    a = torch.randn(4, 16)
    client.update_weights([("base_model.model.x.lora_A.weight", a)], lora={"peft_config": {}, "lora_int_id": 1})
    full, lora, post, received = _counters(client)
    assert (full, lora, post) == (before[0], before[1] + 1, before[2])
    assert client.score([[0]])[0] == pytest.approx([float(a.sum())])


def test_server_errors_come_back_and_server_survives(client):
    with pytest.raises(RuntimeError, match="coverage check failed: fail.me"):
        client.update_weights([("fail.me", torch.ones(2))])
    assert _counters(client)[3] >= 1  # still serving
