"""Server mode with a real vLLM engine in a separate process, updated by the trainer over gloo."""

import pytest
import torch

pytestmark = pytest.mark.vllm

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def test_server_generate_and_full_sync(tmp_path):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams
    from verl.workers.rollout.vllm_rollout.server import vLLMServerClient
    from tests.vllm_testing import (
        build_engine_checkpoint,
        model_config,
        rollout_config,
        sgd_step,
        trainer_logprobs,
    )
    from verl.workers.weight_sync import iter_hf_weights

    hf = build_engine_checkpoint(tmp_path, "dense")
    client = vLLMServerClient(rollout_config(), model_config(tmp_path), backend="gloo")
    try:
        out = client.generate([GenerationRequest([5, 6, 7])], SamplingParams(n=2, max_tokens=4, seed=0))
        assert len(out[0]) == 2 and all(len(o.log_probs) == 4 for o in out[0])
        before = torch.tensor(client.score([SEQ])[0])
        sgd_step(hf, SEQ, lr=0.3)
        trainer = trainer_logprobs(hf, SEQ)
        moved = (trainer - before).abs().max().item()  # engine pre-step scores == trainer's (bf16)
        client.update_weights(iter_hf_weights(hf, bucket_megabytes=1, dtype=torch.bfloat16))
        after = torch.tensor(client.score([SEQ])[0])
        assert (after - before).abs().max().item() > 0.5
        assert (after - trainer).abs().max().item() < 0.25 * moved
        # A partial sync fails on the server by name and the error reaches the trainer.
        partial = ((n, t) for n, t in iter_hf_weights(hf, dtype=torch.bfloat16) if n != "model.norm.weight")
        with pytest.raises(RuntimeError, match=r"never written: model\.norm\.weight"):
            client.update_weights(partial)
    finally:
        client.shutdown()
