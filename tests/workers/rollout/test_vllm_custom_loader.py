"""A weight loader registered for an architecture replaces vLLM's ``load_weights`` in the sync (vLLM CPU build)."""

import gc

import pytest
import torch

from tests.vllm_testing import fresh_engine_scores, model_config, rollout_config, sgd_step

pytestmark = pytest.mark.vllm

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


@pytest.fixture
def registered():
    from verl.models.dtensor_weight_loader import WEIGHT_LOADER_REGISTRY, register_weight_loader

    calls = []

    def llama_loader(actor_weights, vllm_model):
        calls.append(sorted(actor_weights))
        skip = calls_skip[0]
        # Seed 003's pattern reduced to its core: hand the (renamed, here identical) tensors to the model
        # class's loader, which calls each parameter's weight_loader.
        type(vllm_model).load_weights(vllm_model, ((n, w) for n, w in actor_weights.items() if n != skip))
        return vllm_model

    calls_skip = [None]
    register_weight_loader("LlamaForCausalLM", llama_loader)
    yield calls, calls_skip
    WEIGHT_LOADER_REGISTRY.pop("LlamaForCausalLM", None)


def test_registered_loader_syncs_and_is_coverage_checked(tmp_path, registered):
    from tests.generic_models import build_generic_lm
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout
    from verl.workers.weight_sync import WeightCoverageError, iter_hf_weights

    calls, skip = registered
    hf = build_generic_lm(tmp_path / "model", "llama", tie=False)
    engine = vLLMRollout(rollout_config(), model_config(tmp_path / "model"), tokenizer=None)
    try:
        assert engine.custom_loader is not None
        sgd_step(hf, SEQ, lr=0.3)
        engine.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))
        assert calls and "model.layers.0.self_attn.q_proj.weight" in calls[-1]
        synced = torch.tensor(engine.score([SEQ])[0])
        skip[0] = "model.norm.weight"
        with pytest.raises(WeightCoverageError, match=r"never written: model\.norm\.weight"):
            engine.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))
    finally:
        engine.shutdown()
        gc.collect()
    fresh = fresh_engine_scores(hf, tmp_path / "model", tmp_path / "fresh", SEQ)
    assert (synced - fresh).abs().max().item() < 0.02
