"""Rollout config -> vllm.LLM kwargs and sampling/outputs conversion (CPU seams, no vLLM import)."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from verl.workers.rollout.base import SamplingParams
from verl.workers.rollout.vllm_rollout.engine_args import (
    bucket_megabytes,
    build_llm_kwargs,
    check_every_layer_routes,
    to_generation_outputs,
    vllm_sampling_kwargs,
)


def _cfg(**kw):
    base = dict(name="vllm", prompt_length=64, response_length=32, tensor_model_parallel_size=1,
                gpu_memory_utilization=0.6, load_format="dummy_dtensor", max_num_batched_tokens=4096,
                max_model_len=None, max_num_seqs=8, enable_chunked_prefill=False, enforce_eager=True,
                free_cache_engine=True, dtype="bf16", engine_kwargs={"vllm": {"swap_space": 0}},
                checkpoint_engine={"update_weights_bucket_megabytes": 128})
    base.update(kw)
    return OmegaConf.create(base)


def test_gpu_kwargs_from_upstream_keys():
    kw = build_llm_kwargs(_cfg(tensor_model_parallel_size=2), OmegaConf.create({"path": "/m", "lora_rank": 16}),
                          on_gpu=True)
    assert kw["model"] == "/m" and kw["skip_tokenizer_init"] is True
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["max_model_len"] == 96  # prompt + response when unset
    assert kw["dtype"] == "bfloat16"
    assert kw["load_format"] == "auto"  # LoRA: the frozen base is read from the checkpoint, not synced
    assert kw["enable_sleep_mode"] is True and kw["gpu_memory_utilization"] == 0.6
    assert kw["max_num_batched_tokens"] == 4096 and kw["enable_chunked_prefill"] is False
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["enable_prefix_caching"] is True
    assert kw["enable_lora"] and kw["max_lora_rank"] == 16
    assert kw["swap_space"] == 0  # engine_kwargs.vllm passes through last


def test_cpu_kwargs_and_limits():
    kw = build_llm_kwargs(_cfg(), OmegaConf.create({"path": "/m"}), on_gpu=False, is_vl=True)
    assert "enable_sleep_mode" not in kw and "distributed_executor_backend" not in kw
    assert kw["language_model_only"] is True and "enable_lora" not in kw
    assert kw["load_format"] == "dummy"  # full-weight sync fills the engine; no checkpoint read
    with pytest.raises(ValueError, match="needs GPUs"):
        build_llm_kwargs(_cfg(tensor_model_parallel_size=2), {"path": "/m"}, on_gpu=False)
    with pytest.raises(ValueError, match="max_model_len"):
        build_llm_kwargs(_cfg(max_model_len=50), {"path": "/m"}, on_gpu=False)


def test_engine_loads_the_resolved_model_directory():
    # vLLMRollout passes the directory model.path resolved to (a hub id's HF-cache snapshot): vLLM must read
    # that, not the raw key.
    kw = build_llm_kwargs(_cfg(), {"path": "Qwen/Qwen3.5-9B"}, on_gpu=False, model_path="/cache/snapshots/abc")
    assert kw["model"] == "/cache/snapshots/abc"
    assert build_llm_kwargs(_cfg(), {"path": "/m"}, on_gpu=False)["model"] == "/m"


def test_bucket_size_location():
    assert bucket_megabytes(_cfg()) == 128  # upstream: rollout.checkpoint_engine.update_weights_bucket_megabytes
    assert bucket_megabytes(OmegaConf.create({"update_weights_bucket_megabytes": 64})) == 64
    assert bucket_megabytes(OmegaConf.create({})) == 2048


@pytest.mark.parametrize("top_k,want", [(0, -1), (-1, -1), (20, 20)])
def test_top_k_disable(top_k, want):
    assert vllm_sampling_kwargs(SamplingParams(top_k=top_k))["top_k"] == want


def test_greedy_and_logprobs():
    kw = vllm_sampling_kwargs(SamplingParams(temperature=0, top_p=0.5, logprobs=False, stop_token_ids=[7]))
    assert kw["temperature"] == 0.0 and kw["top_p"] == 1.0 and kw["logprobs"] is None
    assert kw["stop_token_ids"] == [7] and kw["detokenize"] is False
    assert vllm_sampling_kwargs(SamplingParams())["logprobs"] == 0  # sampled token's log-prob only
    # the stop ids are the whole list: vLLM adds no EOS of the checkpoint's generation config (rollout.ignore_eos)
    assert vllm_sampling_kwargs(SamplingParams(stop_token_ids=[]))["ignore_eos"] is True


def _completion(ids, lps, reason):
    steps = None if lps is None else [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, lps)]
    return SimpleNamespace(token_ids=ids, logprobs=steps, finish_reason=reason)


def test_outputs_conversion():
    ro = SimpleNamespace(outputs=[_completion([3, 4], [-0.5, -1.5], "stop"), _completion([5], [-0.1], "length")])
    outs = to_generation_outputs(ro, want_logprobs=True)
    assert [o.token_ids for o in outs] == [[3, 4], [5]]
    assert outs[0].log_probs == [-0.5, -1.5] and outs[0].finish_reason == "stop"
    assert outs[1].finish_reason == "length"
    with pytest.raises(RuntimeError, match="log-probs"):
        to_generation_outputs(SimpleNamespace(outputs=[_completion([3], None, "stop")]), want_logprobs=True)
    assert to_generation_outputs(SimpleNamespace(outputs=[_completion([3], None, None)]), False)[0].log_probs is None


def test_registry_points_at_engine_and_import_error_names_extra(monkeypatch):
    import sys

    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.vllm_rollout import create_vllm_rollout, vllm_rollout

    assert get_rollout_class("vllm") is create_vllm_rollout and hasattr(vllm_rollout, "vLLMRollout")
    monkeypatch.setitem(sys.modules, "vllm", None)  # simulate a missing install
    with pytest.raises(ImportError, match=r"pip install -e \.\[vllm\]"):
        vllm_rollout.import_vllm()


def test_parallel_keys_reach_vllm_or_are_refused():
    # rollout.data_parallel_size, rollout.expert_parallel_size (the distillation teacher's inference.* has keys of
    # the same names)
    kw = build_llm_kwargs(_cfg(tensor_model_parallel_size=2, data_parallel_size=2, expert_parallel_size=4),
                          {"path": "/m"}, on_gpu=True)
    assert kw["tensor_parallel_size"] == 2 and kw["data_parallel_size"] == 2 and kw["enable_expert_parallel"]
    plain = build_llm_kwargs(_cfg(data_parallel_size=1, expert_parallel_size=1), {"path": "/m"}, on_gpu=True)
    assert "data_parallel_size" not in plain and "enable_expert_parallel" not in plain
    with pytest.raises(ValueError, match=r"rollout\.expert_parallel_size=2 must equal tensor_model_parallel_size"):
        build_llm_kwargs(_cfg(tensor_model_parallel_size=2, data_parallel_size=2, expert_parallel_size=2),
                         {"path": "/m"}, on_gpu=True)
    with pytest.raises(ValueError, match=r"rollout\.pipeline_model_parallel_size=2"):
        build_llm_kwargs(_cfg(pipeline_model_parallel_size=2), {"path": "/m"}, on_gpu=True)
    for key in ("data_parallel_size", "expert_parallel_size"):
        with pytest.raises(ValueError, match=rf"rollout\.{key}=2 needs GPUs"):
            build_llm_kwargs(_cfg(**{key: 2}), {"path": "/m"}, on_gpu=False)


def test_sleep_mode_keys():
    kw = build_llm_kwargs(_cfg(free_cache_engine=False, enable_sleep_mode=False), {"path": "/m"}, on_gpu=True)
    assert kw["enable_sleep_mode"] is False
    with pytest.raises(ValueError, match="free_cache_engine=True needs enable_sleep_mode=True"):
        build_llm_kwargs(_cfg(free_cache_engine=True, enable_sleep_mode=False), {"path": "/m"}, on_gpu=True)
    server = build_llm_kwargs(_cfg(), {"path": "/m"}, on_gpu=True, standalone=True)
    assert "distributed_executor_backend" not in server  # a server process is not a shard of a trainer rank


# ---------------------------------------------------------------- CUDA engines (pure rules, checked on CPU)
def test_colocated_engine_outside_a_process_group_uses_vllms_own_executor():
    # No trainer group (a notebook, a test): vLLM's external launcher would read RANK / MASTER_ADDR that are unset.
    kw = build_llm_kwargs(_cfg(), {"path": "/m"}, on_gpu=True, in_process_group=False)
    assert "distributed_executor_backend" not in kw
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 needs the trainer's process group"):
        build_llm_kwargs(_cfg(tensor_model_parallel_size=2), {"path": "/m"}, on_gpu=True, in_process_group=False)
    assert build_llm_kwargs(_cfg(), {"path": "/m"}, on_gpu=True)["distributed_executor_backend"] == "external_launcher"


def test_without_flashinfer_sets_the_sampler_off_and_triton_gdn_prefill_with_warnings():
    from verl.workers.rollout.vllm_rollout.engine_args import without_flashinfer

    kw, env, warnings = without_flashinfer({"model": "/m"}, {}, linear_attention=True, gdn_backend_arg=True)
    assert env == {"VLLM_USE_FLASHINFER_SAMPLER": "0"} and kw["gdn_prefill_backend"] == "triton"
    assert len(warnings) == 2 and all("FlashInfer is not installed" in w for w in warnings)
    # A user's explicit choices: triton stays silent; flashinfer is refused by key; the sampler variable too.
    kw, env, warnings = without_flashinfer({"gdn_prefill_backend": "triton"}, {"VLLM_USE_FLASHINFER_SAMPLER": "0"},
                                           linear_attention=True, gdn_backend_arg=True)
    assert (kw["gdn_prefill_backend"], env, warnings) == ("triton", {}, [])
    with pytest.raises(ValueError, match="engine_kwargs.vllm.gdn_prefill_backend=flashinfer"):
        without_flashinfer({"gdn_prefill_backend": "flashinfer"}, {}, linear_attention=True, gdn_backend_arg=True)
    with pytest.raises(ValueError, match="VLLM_USE_FLASHINFER_SAMPLER=1 asks vLLM for FlashInfer's sampler"):
        without_flashinfer({}, {"VLLM_USE_FLASHINFER_SAMPLER": "1"}, linear_attention=False, gdn_backend_arg=True)
    # No linear attention, or a vLLM without the argument: the engine kwargs stay as they were.
    kw, _, _ = without_flashinfer({"model": "/m"}, {}, linear_attention=False, gdn_backend_arg=True)
    assert "gdn_prefill_backend" not in kw
    kw, _, _ = without_flashinfer({"model": "/m"}, {}, linear_attention=True, gdn_backend_arg=False)
    assert "gdn_prefill_backend" not in kw


def test_nccl_server_refuses_the_trainers_gpu_and_takes_another():
    import torch

    from verl.workers.rollout.vllm_rollout.server import server_device

    gpu0 = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="refuses two processes on one GPU.*VERL_ROLLOUT_SERVER_DEVICE=cuda:N"):
        server_device("nccl", gpu0, None)
    assert server_device("nccl", gpu0, "cuda:1") == torch.device("cuda", 1)
    assert server_device("gloo", None, None) is None  # CPU hosts: the server shares nothing but the host
    with pytest.raises(ValueError, match="must be a cuda device"):
        server_device("nccl", gpu0, "cpu")


# ---------------------------------------------------------------------------------------------- router replay (R3)

def test_routing_replay_asks_vllm_for_the_routed_experts():
    model = OmegaConf.create({"path": "/m"})
    on = build_llm_kwargs(_cfg(enable_rollout_routing_replay=True), model, on_gpu=True)
    assert on["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in build_llm_kwargs(_cfg(), model, on_gpu=True)


def test_vllm_routes_become_the_batch_layout():
    """vLLM hands routes as numpy in the narrowest dtype (uint8 for <= 256 experts) over the tokens it routed (the
    last sampled token is never fed back); they become signed (prompt + response, layers, top_k) with -1 there,
    which the batch assembly places like input_ids."""
    import numpy as np
    import torch

    from verl.workers.rollout.batching import routes_to_batch

    rng = np.random.default_rng(0)
    prompt, resp = [11, 12, 13], [21, 22, 23, 24]
    routed = rng.integers(0, 200, size=(len(prompt) + len(resp) - 1, 2, 4)).astype(np.uint8)
    request = SimpleNamespace(prompt_token_ids=prompt, outputs=[SimpleNamespace(
        token_ids=resp, logprobs=None, finish_reason="length", routed_experts=routed)])
    (out,) = to_generation_outputs(request, want_logprobs=False, want_routes=True)
    r = out.routed_experts
    assert r.dtype == torch.int16 and tuple(r.shape) == (7, 2, 4)
    assert torch.equal(r[:6], torch.as_tensor(routed.astype(np.int64)).to(torch.int16))
    assert (r[6] == -1).all()  # 255 would have been an expert id in uint8
    prompt_mask = torch.tensor([[0, 1, 1, 1]])  # one left-pad slot
    batch = routes_to_batch(prompt_mask, 5, [out])
    assert tuple(batch.shape) == (1, 9, 2, 4)
    assert (batch[0, 0] == -1).all() and torch.equal(batch[0, 1:4], r[:3]) and torch.equal(batch[0, 4:8], r[3:])
    assert (batch[0, 8] == -1).all()  # response padding
    (plain,) = to_generation_outputs(request, want_logprobs=False)
    assert plain.routed_experts is None
    request.outputs[0].routed_experts = None
    with pytest.raises(RuntimeError, match="returned no routed_experts"):
        to_generation_outputs(request, want_logprobs=False, want_routes=True)


def test_vllm_routes_need_every_decoder_layer_to_be_moe():
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    check_every_layer_routes(tf.Qwen3_5MoeTextConfig(**tiny_text_config_kwargs(num_experts=4, num_experts_per_tok=2)))
    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                 intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    check_every_layer_routes(tf.Qwen3MoeConfig(**small))
    with pytest.raises(ValueError, match="mlp_only_layers=\\[0\\]"):
        check_every_layer_routes(tf.Qwen3MoeConfig(**small, mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="needs a MoE model"):
        check_every_layer_routes(tf.Qwen3Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                intermediate_size=64, vocab_size=64))

