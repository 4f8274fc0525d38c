"""What engines read instead of role and engine names: the role object and the per-engine config layout."""

import pytest
from omegaconf import OmegaConf

from verl.workers.engine import ENGINE_SECTIONS, EngineSections
from verl.workers.engine.role import ENGINE_ROLES, EngineRole, engine_role, register_engine_role
from verl.workers.engine.sections import engine_section, ranks_per_dp_replica


def test_roles_say_head_output_and_training():
    actor, ref, critic = engine_role("actor"), engine_role("ref"), engine_role("critic")
    assert (actor.output, actor.trainable, actor.lora, actor.multimodal) == ("log_probs", True, True, True)
    assert ref.output == "log_probs" and not ref.trainable and not ref.lora
    assert critic.value_head and critic.output == "values" and not critic.multimodal
    assert critic.section == "critic" and critic.model_section == "critic.model"
    with pytest.raises(ValueError, match="not a registered engine role"):
        engine_role("reward_model")
    register_engine_role(EngineRole("reward_model", "value", False, "reward_model.model", "reward_model"))
    try:
        assert engine_role("reward_model").value_head  # a new role is one registration
    finally:
        ENGINE_ROLES.pop("reward_model")


def test_data_parallel_layout_comes_from_the_engine_registration():
    megatron = OmegaConf.create({"strategy": "megatron", "megatron": {"tensor_model_parallel_size": 2,
                                                                      "pipeline_model_parallel_size": 2}})
    assert ranks_per_dp_replica(megatron) == 4  # context parallel defaults to 1
    assert ranks_per_dp_replica(OmegaConf.create({"ulysses_sequence_parallel_size": 2})) == 2  # fsdp2 default
    critic = OmegaConf.create({"strategy": "fsdp", "fsdp": {"param_offload": True}})
    assert engine_section(critic, "fsdp")["param_offload"] is True  # the critic's FSDP section is critic.fsdp
    ENGINE_SECTIONS.register("toy", EngineSections(engine_keys=("toy",), replica_keys=("toy.mp",)))
    try:
        toy = OmegaConf.create({"strategy": "toy", "toy": {"mp": 3}})
        assert ranks_per_dp_replica(toy) == 3 and engine_section(toy, "toy")["mp"] == 3
    finally:
        ENGINE_SECTIONS.pop("toy")
