"""Settings that would be accepted and then never read are refused naming the key (issue 10 item 4):
tool settings with multi-turn off, a router switch another key owns, and rollout parallel sizes the hf engine
has no use for. Each case also checks the legal neighbour, so a rule that refused everything would fail."""

from __future__ import annotations

import warnings

import pytest

from verl.trainer.config import ConfigValidationError, validate_config

R = "actor_rollout_ref.rollout"
MT = R + ".multi_turn"


@pytest.fixture
def problems(compose_fn, valid_overrides):
    """Problems validation reports for the valid setup plus ``extra`` overrides ([] when it passes)."""

    def run(*extra):
        cfg = compose_fn(overrides=valid_overrides + list(extra))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                validate_config(cfg)
        except ConfigValidationError as err:
            return err.problems
        return []

    return run


def _about(problems, key):
    return [p for p in problems if p.startswith(f"`{key}`")]


# --------------------------------------------------------------------------- multi-turn names and tool files


def test_unknown_format_is_refused_with_multi_turn_off(problems):
    found = _about(problems(f"{MT}.format=xml"), f"{MT}.format")
    assert found and "not a registered tool-call parser" in found[0] and "hermes" in found[0], found
    assert _about(problems(f"{MT}.format=qwen3_coder"), f"{MT}.format") == []  # registered: fine
    assert _about(problems(f"{MT}.format=qwen3_xml"), f"{MT}.format") == []  # an alias of qwen3_coder


def test_user_registered_format_is_accepted_with_multi_turn_off(problems):
    from verl.experimental.agent_loop.tool_parser import TOOL_PARSER_REGISTRY

    assert _about(problems(f"{MT}.format=my_syntax"), f"{MT}.format")
    TOOL_PARSER_REGISTRY.register("my_syntax", object())
    try:
        assert _about(problems(f"{MT}.format=my_syntax"), f"{MT}.format") == []
    finally:
        del TOOL_PARSER_REGISTRY["my_syntax"]


def test_unknown_default_agent_loop_is_refused_with_multi_turn_off(problems):
    assert _about(problems(f"{R}.agent.default_agent_loop=nope"), f"{R}.agent.default_agent_loop")
    assert _about(problems(f"{R}.agent.default_agent_loop=tool_agent"), f"{R}.agent.default_agent_loop") == []


@pytest.mark.parametrize("key", [f"{MT}.function_tool_path", "data.function_tool_path", f"{MT}.tool_config_path",
                                 "data.tool_config_path"])
def test_tool_files_need_multi_turn(problems, key):
    found = _about(problems(f"{key}=/x/tools.py"), key)
    assert len(found) == 1 and f"`{MT}.enable=true`" in found[0], found
    assert problems(f"{key}=/x/tools.py", f"{MT}.enable=true") == []  # read by the agent loop then


def test_mirrored_data_key_is_not_reported_twice(problems):
    # data.function_tool_path follows the multi-turn key by interpolation; only the key the user set is named.
    found = problems(f"{MT}.function_tool_path=/x/tools.py")
    assert _about(found, f"{MT}.function_tool_path") and not _about(found, "data.function_tool_path"), found


# --------------------------------------------------------------------------- the MoE router switch


@pytest.mark.parametrize("model", ["actor_rollout_ref.model", "critic.model"])
def test_output_router_logits_points_at_enable_router_aux_loss(problems, model):
    key = f"{model}.override_config.output_router_logits"
    found = _about(problems(f"+{key}=true"), key)
    assert len(found) == 1 and "actor_rollout_ref.model.enable_router_aux_loss" in found[0], found
    assert problems(f"+{key}=false") == []  # what the loader does anyway


def test_enable_router_aux_loss_is_the_accepted_spelling(problems):
    assert problems("actor_rollout_ref.model.enable_router_aux_loss=true") == []


# --------------------------------------------------------------------------- hf rollout parallel sizes

SIZES = ["tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size"]


@pytest.mark.parametrize("key", SIZES)
def test_hf_refuses_parallel_sizes_it_ignores(problems, key):
    found = _about(problems(f"{R}.{key}=4"), f"{R}.{key}")
    assert len(found) == 1 and "rollout.name=hf" in found[0] and "set it to 1" in found[0], found
    assert problems(f"{R}.{key}=1") == []


def test_hf_accepts_the_shipped_tensor_parallel_default(problems, compose_fn, valid_overrides):
    # tensor_model_parallel_size ships as 2 (for vLLM); every hf run carries it.
    assert compose_fn(overrides=valid_overrides).actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert problems() == []


def test_vllm_keeps_its_parallel_sizes(problems):
    # The same values are meaningful for vLLM: the hf rule must not reach them.
    assert problems(f"{R}.name=vllm", f"{R}.tensor_model_parallel_size=1", f"{R}.data_parallel_size=2") == []
