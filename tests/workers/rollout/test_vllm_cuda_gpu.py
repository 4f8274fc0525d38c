"""CUDA vLLM: what only a GPU shows (run by scripts/gpu_vllm.sh on the lent machine; skipped elsewhere).

* the text-only Qwen3.5 architectures start through the project's vLLM plugin, with vLLM's FlashInfer
  defaults replaced where FlashInfer is not installed;
* sleep mode really releases the engine's memory, and wake-up + sync brings back the same engine;
* CUDA graphs captured before a reload replay with the reloaded weights (they read the same storage);
* server mode over NCCL: the server on its own GPU where the host has two, else the same-GPU refusal.

The sync-equals-fresh-engine cases (dense tied/untied, MoE, VL text), LoRA and the engine tests in the
other vllm-marked files run on CUDA too (gpu_vllm.sh selects them); this file adds the CUDA-only parts.
"""

import gc
import os

import pytest
import torch

from tests.vllm_testing import build_engine_checkpoint, model_config, rollout_config, trainer_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


def _engine(path, **overrides):
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    return vLLMRollout(rollout_config(**overrides), model_config(path), tokenizer=None)


def _greedy(rollout, n_tokens=12):
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    outs = rollout.generate([GenerationRequest(p) for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=n_tokens, stop_token_ids=[]))
    return [o[0].token_ids for o in outs]


def _used_gib():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def test_text_only_checkpoint_starts_through_the_plugin(tmp_path):
    import importlib.util

    from vllm import ModelRegistry

    hf = build_engine_checkpoint(tmp_path / "m", "dense")
    engine = _engine(tmp_path / "m")
    try:
        assert "Qwen3_5ForCausalLM" in ModelRegistry.get_supported_archs()
        assert type(engine.engine_model).__name__.startswith("Qwen3_5")
        if importlib.util.find_spec("flashinfer") is None:
            assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") == "0"
            extra = engine.llm.llm_engine.vllm_config.additional_config or {}
            assert extra.get("gdn_prefill_backend") == "triton", extra
        gap = (torch.tensor(engine.score([SEQ])[0]) - trainer_logprobs(hf, SEQ)).abs().max().item()
        assert gap < 0.1, f"engine vs trainer log-prob gap {gap:.3f} on the same weights"
    finally:
        engine.shutdown()
        gc.collect()


def test_sleep_releases_memory_and_wake_plus_sync_restores_the_engine(tmp_path):
    from verl.workers.weight_sync import iter_hf_weights

    hf = build_engine_checkpoint(tmp_path / "m", "dense")
    engine = _engine(tmp_path / "m", enforce_eager=False, free_cache_engine=True, enable_sleep_mode=True)
    try:
        assert engine.sleeps
        before = _greedy(engine)
        used_awake = _used_gib()
        engine.sleep()  # level 2 (full weights follow every wake-up)
        used_asleep = _used_gib()
        assert engine.weights_lost_in_sleep
        # The KV cache is most of what gpu_memory_utilization=0.15 reserved; the weights are tiny.
        reserved = 0.15 * torch.cuda.get_device_properties(0).total_memory / 2**30
        assert used_awake - used_asleep > 0.5 * reserved, (used_awake, used_asleep, reserved)
        assert engine.memory_metrics["perf/rollout_device_memory_before_sleep_gb"] > \
            engine.memory_metrics["perf/rollout_device_memory_after_sleep_gb"]
        engine.wake_up(("weights",))
        engine.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))
        engine.wake_up(("kv_cache",))
        assert not engine.is_sleeping
        assert _greedy(engine) == before
    finally:
        engine.shutdown()
        gc.collect()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cuda_graphs_replay_the_reloaded_weights(tmp_path, kind):
    """Graphs captured at start-up read the parameters' storage; a layerwise reload must write into it."""
    from tests.workers.rollout.test_vllm_sync_matches_fresh import _step_and_compare

    hf = build_engine_checkpoint(tmp_path / "model", kind)
    # The fresh engine captures graphs too: compiled and eager kernels differ by more than run-to-run noise.
    _step_and_compare(tmp_path, hf, lambda: _engine(tmp_path / "model", enforce_eager=False), enforce_eager=False)


def test_server_mode_over_nccl(tmp_path, monkeypatch):
    from tests.workers.rollout.test_vllm_sync_matches_fresh import _step_and_compare
    from verl.workers.rollout.vllm_rollout.server import SERVER_DEVICE_ENV, vLLMServerClient

    hf = build_engine_checkpoint(tmp_path / "model", "dense")
    if torch.cuda.device_count() < 2:
        monkeypatch.delenv(SERVER_DEVICE_ENV, raising=False)
        with pytest.raises(ValueError, match="refuses two processes on one GPU"):
            vLLMServerClient(rollout_config(), model_config(tmp_path / "model"), backend="nccl")
        pytest.skip("one GPU: NCCL server mode needs the server on a second GPU (the refusal was checked)")
    monkeypatch.setenv(SERVER_DEVICE_ENV, "cuda:1")
    _step_and_compare(tmp_path, hf, lambda: vLLMServerClient(rollout_config(), model_config(tmp_path / "model"),
                                                             backend="nccl"))


def test_lora_sync_on_moe(tmp_path):
    """vLLM's MoE LoRA needs a GPU (Triton): a fused-expert adapter moves the engine like the trainer."""
    from peft import LoraConfig, get_peft_model

    from verl.workers.weight_sync import iter_hf_weights

    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    hf = build_engine_checkpoint(tmp_path / "m", "moe")
    engine = vLLMRollout(rollout_config(), model_config(tmp_path / "m", lora_rank=8), tokenizer=None)
    try:
        peft_model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.1)
        engine.update_weights(iter_hf_weights(peft_model, lora_mode="base", dtype=torch.bfloat16))
        base = torch.tensor(engine.score([SEQ])[0])
        engine.update_weights(iter_hf_weights(peft_model, lora_mode="adapter"),
                              lora={"peft_config": peft_model.peft_config["default"], "lora_int_id": 1})
        adapted = torch.tensor(engine.score([SEQ])[0])
        trainer = trainer_logprobs(peft_model, SEQ)
        moved = (trainer - base).abs().max().item()
        assert moved > 0.2, f"the adapter moves the trainer's log-probs by only {moved:.3f}"
        gap = (adapted - trainer).abs().max().item()
        assert gap < 0.25 * moved, (f"engine with the adapter vs trainer {gap:.3f}, adapter's own effect {moved:.3f}; "
                                    f"engine with vs without it {(adapted - base).abs().max().item():.3f}")
    finally:
        engine.shutdown()
        gc.collect()


def test_routed_experts_match_the_trainers_router(tmp_path):
    """rollout.enable_rollout_routing_replay on vLLM (R3): the engine returns, per token of prompt + response, the
    experts each MoE layer chose; the trainer's own routers, fed the same sequence, choose the same experts
    (bf16 engine vs fp32 trainer: a token whose k-th and (k+1)-th router scores are within rounding may flip, so
    the agreement is a high fraction, not all), and the last sampled token is marked unrouted (-1)."""
    from verl.models.transformers.router_replay import RouterTape
    from verl.workers.rollout.base import GenerationRequest, SamplingParams

    hf = build_engine_checkpoint(tmp_path / "m", "moe")
    engine = _engine(tmp_path / "m", enable_rollout_routing_replay=True)
    try:
        prompt = PROMPTS[1]
        (out,), = engine.generate([GenerationRequest(prompt)],
                                  SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[]))
    finally:
        engine.shutdown()
        gc.collect()
    routes = out.routed_experts
    seq = prompt + out.token_ids
    tape = RouterTape(hf)
    assert routes is not None and tuple(routes.shape) == (len(seq), *tape.shape), routes.shape
    assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()
    with torch.no_grad(), tape.recording():
        hf(torch.tensor([seq], device=next(hf.parameters()).device))
    own = tape.stacked().cpu()[: len(seq) - 1]
    engine_sets = routes[:-1].long().sort(dim=-1).values
    same = (own.long().sort(dim=-1).values == engine_sets).all(dim=-1).float().mean().item()
    print(f"[vllm routes] {routes.shape[0]} tokens x {routes.shape[1]} MoE layers x top-{routes.shape[2]}: "
          f"{same:.1%} of (token, layer) expert sets equal to the trainer's own routing")
    assert same >= 0.9
