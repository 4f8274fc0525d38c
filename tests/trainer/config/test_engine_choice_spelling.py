"""`actor_rollout_ref.actor.model_engine=X`, where upstream's scaling script writes the engine choice, picks the
engine as the root group choice `model_engine=X` does (issue 27)."""

from __future__ import annotations

import pytest

from verl.trainer.config import ConfigKeyError, compose_config


def test_actor_model_engine_picks_every_roles_engine():
    cfg = compose_config("ppo_trainer", ["actor_rollout_ref.actor.model_engine=megatron"], validate=False)
    assert cfg.model_engine == "megatron"
    # the Megatron sections replace the FSDP ones for the actor, the ref and the critic alike
    assert cfg.actor_rollout_ref.actor.strategy == "megatron" and "megatron" in cfg.actor_rollout_ref.actor
    assert "fsdp_config" not in cfg.actor_rollout_ref.actor and cfg.critic.strategy == "megatron"
    plain = compose_config("ppo_trainer", [], validate=False)
    assert plain.model_engine == "dp" and plain.actor_rollout_ref.actor.strategy != "megatron"


def test_the_same_choice_twice_is_fine_and_a_conflict_is_named():
    cfg = compose_config("ppo_trainer", ["model_engine=megatron", "actor_rollout_ref.actor.model_engine=megatron"],
                         validate=False)
    assert cfg.model_engine == "megatron"
    with pytest.raises(ConfigKeyError, match=r"`model_engine=dp` and `actor_rollout_ref.actor.model_engine=megatron`"
                                             r" pick different training engines"):
        compose_config("ppo_trainer", ["model_engine=dp", "actor_rollout_ref.actor.model_engine=megatron"],
                       validate=False)


def test_megatron_lite_actor_is_refused_naming_the_engine(capsys):
    from verl.trainer.main_ppo import main

    assert main(["actor_rollout_ref.model.path=Qwen/Qwen3.5-35B-A3B", "actor@actor_rollout_ref.actor=mlite_actor",
                 "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Megatron-lite training engine" in err, err
