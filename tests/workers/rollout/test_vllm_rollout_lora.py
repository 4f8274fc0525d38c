"""LoRA sync into the vLLM engine (dense only: vLLM's MoE LoRA backend needs a GPU) and a VL text engine."""

import gc

import pytest
import torch

pytestmark = pytest.mark.vllm

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj",
           "down_proj"]


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from tests.vllm_testing import build_engine_checkpoint, model_config, rollout_config
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    path = tmp_path_factory.mktemp("lora")
    hf = build_engine_checkpoint(path, "dense")
    rollout = vLLMRollout(rollout_config(), model_config(path, lora_rank=8), tokenizer=None)
    peft_model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():  # PEFT starts B at zero (a no-op adapter); make it matter
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    yield rollout, peft_model
    rollout.shutdown()
    gc.collect()


def _sync_adapter(rollout, peft_model):
    from verl.workers.weight_sync import iter_hf_weights

    rollout.update_weights(
        iter_hf_weights(peft_model, lora_mode="adapter"),
        lora={"peft_config": peft_model.peft_config["default"], "lora_int_id": 1},
    )


def test_lora_sync_changes_engine_like_trainer(lora_engine):
    from tests.vllm_testing import sgd_step, trainer_logprobs
    from verl.workers.weight_sync import iter_hf_weights

    rollout, peft_model = lora_engine
    # Base weights first (unmerged), checked for coverage against the LoRA-wrapped engine.
    rollout.update_weights(iter_hf_weights(peft_model, lora_mode="base", dtype=torch.bfloat16))
    base = torch.tensor(rollout.score([SEQ])[0])
    with peft_model.disable_adapter():
        torch.testing.assert_close(base, trainer_logprobs(peft_model, SEQ), atol=0.05, rtol=0)

    _sync_adapter(rollout, peft_model)
    with_adapter = torch.tensor(rollout.score([SEQ])[0])
    trainer = trainer_logprobs(peft_model, SEQ)
    moved = (trainer - base).abs().max().item()
    assert moved > 0.2
    assert (with_adapter - trainer).abs().max().item() < 0.25 * moved

    # Train the adapter only, re-sync it: the engine follows again.
    sgd_step(peft_model, SEQ, lr=0.5, params=[p for n, p in peft_model.named_parameters() if "lora_" in n])
    trainer2 = trainer_logprobs(peft_model, SEQ)
    moved2 = (trainer2 - trainer).abs().max().item()
    assert moved2 > 0.2
    _sync_adapter(rollout, peft_model)
    engine2 = torch.tensor(rollout.score([SEQ])[0])
    assert (engine2 - trainer2).abs().max().item() < 0.25 * moved2


def test_lora_generation_uses_the_adapter(lora_engine):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    rollout, _ = lora_engine
    out = rollout.generate([GenerationRequest([5, 6, 7])], SamplingParams(n=1, max_tokens=4, seed=0))
    assert rollout._lora_request is not None and len(out[0][0].token_ids) == 4


def test_vl_checkpoint_text_engine_sync(tmp_path):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams
    from tests.vllm_testing import build_engine_checkpoint, model_config, rollout_config
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout
    from verl.workers.weight_sync import iter_hf_weights

    hf = build_engine_checkpoint(tmp_path, "vl")
    rollout = vLLMRollout(rollout_config(), model_config(tmp_path), tokenizer=None)
    try:
        assert not any(n.startswith("visual.") for n in rollout._engine_names)  # language_model_only
        assert rollout.generate([GenerationRequest([5, 6, 7])], SamplingParams(max_tokens=3))[0][0].token_ids
        with torch.no_grad():
            hf.lm_head.weight.mul_(2.0)
        before = rollout.score([SEQ])[0]
        # The vision tower is streamed too and dropped by the layout; coverage still holds.
        rollout.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))
        assert rollout.score([SEQ])[0] != pytest.approx(before, abs=1e-3)
    finally:
        rollout.shutdown()
