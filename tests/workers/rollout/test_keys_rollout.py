"""The ``actor_rollout_ref.rollout`` keys reach the rollout: vLLM's engine arguments, the sampling parameters of
training and validation generation, the engine class, and the weight sync.

Each test composes ``ppo_trainer`` with the key changed and passes the composed rollout section through the
function the rollout worker calls (``build_llm_kwargs`` for ``vllm.LLM``, ``server_backend``,
``sampling_params_from_config``, ``get_rollout_class``, the worker's weight sync), without importing vLLM:
test_vllm_*.py run the engine itself. The key names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.trainer.config.checks import compose_config
from verl.workers.rollout.vllm_rollout.engine_args import build_llm_kwargs, server_backend

R = "actor_rollout_ref.rollout"


def _cfg(*overrides):
    cfg = compose_config("ppo_trainer", [f"{R}.name=vllm", "actor_rollout_ref.model.path=/m", *overrides],
                         validate=False)
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref


def _llm(*overrides, on_gpu=True):
    arr = _cfg(*overrides)
    return build_llm_kwargs(arr.rollout, arr.model, on_gpu=on_gpu)


@pytest.mark.parametrize("key, value, arg, expected", [
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", 4, "tensor_parallel_size", 4),
    ("actor_rollout_ref.rollout.data_parallel_size", 2, "data_parallel_size", 2),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", 0.3, "gpu_memory_utilization", 0.3),
    ("actor_rollout_ref.rollout.max_num_batched_tokens", 1234, "max_num_batched_tokens", 1234),
    ("actor_rollout_ref.rollout.max_model_len", 5000, "max_model_len", 5000),
    ("actor_rollout_ref.rollout.max_num_seqs", 7, "max_num_seqs", 7),
    ("actor_rollout_ref.rollout.enable_chunked_prefill", False, "enable_chunked_prefill", False),
    ("actor_rollout_ref.rollout.enforce_eager", True, "enforce_eager", True),
    ("actor_rollout_ref.rollout.enable_prefix_caching", False, "enable_prefix_caching", False),
    ("actor_rollout_ref.rollout.load_format", "safetensors", "load_format", "safetensors"),
    ("actor_rollout_ref.rollout.load_format", "auto", "load_format", "auto"),
    ("actor_rollout_ref.rollout.dtype", "float16", "dtype", "float16"),
    ("actor_rollout_ref.rollout.seed", 1234, "seed", 1234),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm", "{swap_space:3}", "swap_space", 3),
])
def test_vllm_engine_arguments(key, value, arg, expected):
    before = _llm().get(arg)
    assert before != expected  # the default differs, so the change is the key's doing
    prefix = "++" if key.endswith("engine_kwargs.vllm") else ""  # an empty mapping in the YAML
    assert _llm(f"{prefix}{key}={value}")[arg] == expected


def test_max_model_len_below_prompt_plus_response_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        _llm("actor_rollout_ref.rollout.max_model_len=8")


def test_free_cache_engine_needs_sleep_mode():
    with pytest.raises(ValueError, match="free_cache_engine"):
        _llm("actor_rollout_ref.rollout.free_cache_engine=true", "actor_rollout_ref.rollout.enable_sleep_mode=false")
    kw = _llm("actor_rollout_ref.rollout.free_cache_engine=false", "actor_rollout_ref.rollout.enable_sleep_mode=false")
    assert kw["enable_sleep_mode"] is False


def test_enable_sleep_mode_defaults_on_and_takes_upstreams_plus_form():
    """Upstream's YAML leaves enable_sleep_mode out (its dataclass defaults it to true), so its scripts add it
    with `+`; here the key is null (on), which Hydra lets `+` set."""
    assert _llm()["enable_sleep_mode"] is True
    kw = _llm("actor_rollout_ref.rollout.free_cache_engine=false", "+actor_rollout_ref.rollout.enable_sleep_mode=False")
    assert kw["enable_sleep_mode"] is False


def test_checkpoint_engine_backend_chooses_the_server_collective():
    assert server_backend(_cfg().rollout, "cpu") is None  # naive: the engine lives in the trainer process
    assert server_backend(_cfg("actor_rollout_ref.rollout.checkpoint_engine.backend=gloo").rollout, "cpu") == "gloo"
    assert server_backend(_cfg("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl").rollout, "cuda") == "nccl"
    with pytest.raises(ValueError, match="needs a cuda device"):
        server_backend(_cfg("actor_rollout_ref.rollout.checkpoint_engine.backend=nccl").rollout, "cpu")


# ------------------------------------------------------------------------------------------ sampling
def _params(*overrides, validate=False, meta=None):
    from verl.workers.rollout.batching import sampling_params_from_config

    rollout = _cfg(*overrides).rollout
    return sampling_params_from_config(rollout, {"validate": validate, **(meta or {})}, eos_ids=[7])


def test_training_sampling_keys():
    p = _params("actor_rollout_ref.rollout.temperature=0.6", "actor_rollout_ref.rollout.top_p=0.7",
                "actor_rollout_ref.rollout.top_k=5")
    assert (p.temperature, p.top_p, p.top_k, p.stop_token_ids) == (0.6, 0.7, 5, [7])
    assert _params("actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.temperature=0.6").temperature == 0.0
    assert _params("actor_rollout_ref.rollout.ignore_eos=true").stop_token_ids == []


def test_validation_sampling_keys():
    p = _params("actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=0.4",
                "actor_rollout_ref.rollout.val_kwargs.top_p=0.3", "actor_rollout_ref.rollout.val_kwargs.top_k=9",
                "actor_rollout_ref.rollout.temperature=0.9", validate=True)
    assert (p.temperature, p.top_p, p.top_k) == (0.4, 0.3, 9)  # val_kwargs, not the training values
    greedy = _params("actor_rollout_ref.rollout.val_kwargs.temperature=0.4", validate=True)
    assert greedy.temperature == 0.0  # val_kwargs.do_sample=false (default): greedy


def test_rollout_name_picks_the_engine():
    from verl.workers.rollout.base import get_rollout_class

    assert get_rollout_class(_cfg("actor_rollout_ref.rollout.name=hf").rollout.name).__name__ == "HFRollout"
    assert get_rollout_class(_cfg("actor_rollout_ref.rollout.name=vllm").rollout.name).__name__ == "create_vllm_rollout"
    with pytest.raises(Exception, match="nope"):
        get_rollout_class(_cfg("actor_rollout_ref.rollout.name=nope").rollout.name)


def test_layered_summon_reaches_the_weight_sync():
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class Actor:
        def get_rollout_weights(self, bucket_megabytes, layered):
            self.asked = (bucket_megabytes, layered)
            return iter(()), {}

    class Rollout:
        def update_weights(self, weights, **kw):
            self.updated = True

    for value in (True, False):
        w = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
        w.config = _cfg(f"actor_rollout_ref.rollout.layered_summon={value}",
                        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64")
        w.actor_engine, w.rollout = Actor(), Rollout()
        w._sync_rollout_weights()
        assert w.actor_engine.asked == (64, value) and w.rollout.updated


def test_max_response_length_is_the_generation_budget():
    # rollout.response_length follows data.max_response_length
    assert _params("data.max_response_length=11").max_tokens == 11
    assert _params("data.max_response_length=11", meta={"response_length": 5}).max_tokens == 5
