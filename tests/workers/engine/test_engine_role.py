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
    rm = engine_role("reward_model")  # the discriminative reward model: a trained score head, frozen
    assert rm.value_head and rm.output == "values" and not rm.trainable and rm.head == "score"
    with pytest.raises(ValueError, match="not a registered engine role"):
        engine_role("my_scorer")
    register_engine_role(EngineRole("my_scorer", "value", False, "my_scorer.model", "my_scorer"))
    try:
        assert engine_role("my_scorer").value_head  # a new role is one registration
    finally:
        ENGINE_ROLES.pop("my_scorer")


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
