"""Router replay keys: actor.fsdp_config.router_replay.mode (FSDP twin of upstream's megatron block) and
rollout.enable_rollout_routing_replay are accepted in the combinations that run, refused (naming the key)
otherwise; the megatron engine's router_replay.mode follows the same rules."""

import pytest

from verl.trainer.config import ConfigValidationError
from tests.trainer.config.conftest import VALID_OVERRIDES
from verl.trainer.config.checks import compose_config as _compose

HF = "actor_rollout_ref.rollout.name=hf"


def compose_config(name, overrides):
    return _compose(name, [*VALID_OVERRIDES, *overrides])
MODE = "actor_rollout_ref.actor.fsdp_config.router_replay.mode"
RECORD = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def test_r3_with_vllm_routes_validates():
    """vLLM records the routes itself (enable_return_routed_experts), as upstream asks it to."""
    cfg = compose_config("ppo_trainer", ["actor_rollout_ref.rollout.name=vllm", f"{MODE}=R3", f"{RECORD}=true"])
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    compose_config("ppo_megatron_trainer", ["actor_rollout_ref.rollout.name=vllm",
                                            "actor_rollout_ref.actor.megatron.router_replay.mode=R3", f"{RECORD}=true"])


def test_r3_with_rollout_routes_validates():
    cfg = compose_config("ppo_trainer", [HF, f"{MODE}=R3", f"{RECORD}=true"])
    assert cfg.actor_rollout_ref.actor.fsdp_config.router_replay.mode == "R3"
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    compose_config("ppo_trainer", [HF, f"{MODE}=R2"])
    compose_config("ppo_trainer", [HF, f"{RECORD}=true"])  # recording alone (routes ride along unused)


@pytest.mark.parametrize("overrides, key, words", [
    ([HF, f"{MODE}=R3"], MODE, "enable_rollout_routing_replay=true"),
    ([HF, f"{MODE}=R2", f"{RECORD}=true"], MODE, "R3"),
    ([HF, f"{MODE}=R2", "algorithm.rollout_correction.bypass_mode=true"], MODE, "bypass_mode"),
    ([HF, f"{MODE}=R1"], MODE, "valid values"),
    (["actor_rollout_ref.rollout.name=sglang", f"{MODE}=R3", f"{RECORD}=true"], "actor_rollout_ref.rollout.name",
     ""),
    ([HF, f"{MODE}=R3", f"{RECORD}=true", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], MODE,
     "ulysses"),
    ([HF, "actor_rollout_ref.actor.fsdp_config.router_replay.record_file=/tmp/r.pt"],
     "actor_rollout_ref.actor.fsdp_config.router_replay.record_file", ""),
])
def test_refused(overrides, key, words):
    with pytest.raises(ConfigValidationError) as info:
        compose_config("ppo_trainer", overrides)
    msg = str(info.value)
    assert f"`{key}`" in msg and words in msg


MG_MODE = "actor_rollout_ref.actor.megatron.router_replay.mode"


def test_megatron_router_replay_validates():
    cfg = compose_config("ppo_megatron_trainer", [HF, f"{MG_MODE}=R3", f"{RECORD}=true"])
    assert cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
    compose_config("ppo_megatron_trainer", [HF, f"{MG_MODE}=R2"])


@pytest.mark.parametrize("overrides, key, words", [
    ([HF, f"{MG_MODE}=R3"], MG_MODE, "enable_rollout_routing_replay=true"),
    ([HF, f"{MG_MODE}=R2", f"{RECORD}=true"], MG_MODE, "R3"),
    ([HF, f"{MG_MODE}=R2", "algorithm.rollout_correction.bypass_mode=true"], MG_MODE, "bypass_mode"),
    ([HF, f"{MG_MODE}=R4"], MG_MODE, "valid values"),
    ([HF, f"{MG_MODE}=R2", "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_fusion=true"],
     "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_fusion", "router replay"),
    ([HF, f"{MG_MODE}=R2", "actor_rollout_ref.actor.megatron.context_parallel_size=2"], MG_MODE,
     "context_parallel_size > 1"),
    ([HF, "actor_rollout_ref.actor.megatron.router_replay.record_file=/tmp/r.pt"],
     "actor_rollout_ref.actor.megatron.router_replay.record_file", ""),
    ([HF, "actor_rollout_ref.ref.megatron.router_replay.mode=R3", f"{RECORD}=true"],
     "actor_rollout_ref.ref.megatron.router_replay.mode", ""),
])
def test_megatron_refused(overrides, key, words):
    with pytest.raises(ConfigValidationError) as info:
        compose_config("ppo_megatron_trainer", overrides)
    msg = str(info.value)
    assert f"`{key}`" in msg and words in msg
