"""``actor_rollout_ref.rollout.calculate_log_probs``, ``rollout.moe_tensor_parallel_size`` and
``data.trust_remote_code`` change what the rollout / the trainer do (CPU; no vLLM import)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.config.checks import compose_config
from verl.workers.rollout import batching
from verl.workers.rollout.base import BaseRollout, GenerationOutput
from verl.workers.rollout.vllm_rollout import engine_args

R = "actor_rollout_ref.rollout"


def _rollout_cfg(*overrides):
    cfg = compose_config("ppo_trainer", [f"{R}.name=vllm", "actor_rollout_ref.model.path=/m", *overrides],
                         validate=False)
    OmegaConf.resolve(cfg)
    return cfg.actor_rollout_ref


class _Engine(BaseRollout):
    """Two tokens per prompt; log-probs only when the sampling parameters ask for them (as vLLM and hf do)."""

    def __init__(self):
        self.asked = []

    def generate(self, requests, params):
        self.asked.append(params.logprobs)
        return [[GenerationOutput([5, 6], [-0.5, -0.25] if params.logprobs else None, "length")] for _ in requests]

    def update_weights(self, weights, **kwargs):
        pass


def _prompts():
    ids = torch.tensor([[1, 2, 3], [0, 4, 5]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": torch.clamp(mask.cumsum(-1) - 1, min=0)},
                               meta_info={"response_length": 2})


@pytest.mark.parametrize("value", [True, False])
def test_calculate_log_probs_decides_rollout_log_probs(value):
    rollout = _rollout_cfg(f"actor_rollout_ref.rollout.calculate_log_probs={value}").rollout
    engine = _Engine()
    out = batching.generate_sequences(engine, _prompts(), rollout, eos_ids=[9], pad_token_id=0)
    assert engine.asked == [value]  # the engine is told to skip them
    assert ("rollout_log_probs" in out.batch.keys()) is value
    if value:
        assert out.batch["rollout_log_probs"][0].tolist() == [-0.5, -0.25]


def test_calculate_log_probs_in_the_agent_loop():
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 8, "response_length": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
        "calculate_log_probs": False, "val_kwargs": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
        "multi_turn": {"enable": False}}}})
    mgr = AgentLoopManager(cfg, _Engine(), tok, tools=[])
    assert mgr.sampling_params({}).logprobs is False
    out = AgentLoopOutput(prompt_ids=[1, 2], response_ids=[5, 6], response_mask=[1, 1])
    assert "rollout_log_probs" not in mgr.postprocess([out], with_logprobs=False)[0]
    assert "rollout_log_probs" in mgr.postprocess([out], with_logprobs=True)[0]


def test_rollout_correction_needs_calculate_log_probs():
    from verl.trainer.config import ConfigValidationError

    base = [f"{R}.name=hf", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            f"{R}.log_prob_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=grpo",
            "algorithm.rollout_correction.rollout_is=token"]
    compose_config("ppo_trainer", base)
    with pytest.raises(ConfigValidationError, match="actor_rollout_ref.rollout.calculate_log_probs"):
        compose_config("ppo_trainer", [*base, f"{R}.calculate_log_probs=false"])


def test_moe_tensor_parallel_size_reaches_vllm_where_it_has_the_argument(monkeypatch):
    arr = _rollout_cfg(f"{R}.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.moe_tensor_parallel_size=2")
    monkeypatch.setattr(engine_args, "vllm_engine_arg_names", lambda: frozenset({"moe_tensor_parallel_size"}))
    assert engine_args.build_llm_kwargs(arr.rollout, arr.model, on_gpu=True)["moe_tensor_parallel_size"] == 2
    default = _rollout_cfg(f"{R}.tensor_model_parallel_size=4")
    assert "moe_tensor_parallel_size" not in engine_args.build_llm_kwargs(default.rollout, default.model, on_gpu=True)
    monkeypatch.setattr(engine_args, "vllm_engine_arg_names", lambda: frozenset({"tensor_parallel_size"}))
    with pytest.raises(ValueError, match="moe_tensor_parallel_size=2"):
        engine_args.build_llm_kwargs(arr.rollout, arr.model, on_gpu=True)
    cpu = _rollout_cfg(f"{R}.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.moe_tensor_parallel_size=2")
    with pytest.raises(ValueError, match="moe_tensor_parallel_size=2 needs GPUs"):
        engine_args.build_llm_kwargs(cpu.rollout, cpu.model, on_gpu=False)


@pytest.mark.parametrize("data_trust, model_trust, expected", [(False, False, False), (True, False, True),
                                                               (False, True, True)])
def test_data_trust_remote_code_is_the_trainers_tokenizer_trust(monkeypatch, data_trust, model_trust, expected):
    import transformers

    from verl.utils import tokenizer as tokenizer_mod

    seen = []

    class _Tok:
        chat_template = "x"
        pad_token_id = 0

    def fake(path, trust_remote_code=False, **kw):
        seen.append(trust_remote_code)
        return _Tok()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    monkeypatch.setattr("verl.utils.processor.load_processor", lambda path, trust_remote_code=False: None)
    monkeypatch.setattr("verl.utils.model_path.model_config_dir", lambda cfg, key, what, **kw: "/m")
    cfg = compose_config("ppo_trainer", [f"data.trust_remote_code={data_trust}",
                                         f"actor_rollout_ref.model.trust_remote_code={model_trust}"], validate=False)
    tokenizer_mod.controller_tokenizer_and_processor(cfg)
    assert seen == [expected]
