"""Rollout config -> vllm.LLM kwargs and sampling/outputs conversion (CPU seams, no vLLM import)."""

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from verl.workers.rollout.base import SamplingParams
from verl.workers.rollout.vllm_rollout.engine_args import (
    bucket_megabytes,
    build_llm_kwargs,
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
