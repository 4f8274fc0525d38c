"""Ulysses sequence parallelism set in its new upstream home, the role's FSDP engine section
(``actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size``,
``critic.fsdp.ulysses_sequence_parallel_size``), runs as the role key would: the size the workers lay their ranks
out by and the engine shards sequences by. The key names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import pytest

from verl.trainer.config.checks import ConfigValidationError, compose_config
from verl.workers.engine_workers import ranks_per_dp_replica

PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true",
          "trainer.n_gpus_per_node=4", "algorithm.adv_estimator=gae"]


@pytest.fixture
def packed(valid_overrides):
    return [*valid_overrides, *PACKED]


@pytest.mark.parametrize("role,key", [
    ("actor_rollout_ref.actor", "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"),
    ("critic", "critic.fsdp.ulysses_sequence_parallel_size"),
])
def test_engine_section_size_is_the_roles(role, key, packed):
    from omegaconf import OmegaConf

    cfg = compose_config("ppo_trainer", [*packed, f"{key}=2"])
    section = OmegaConf.select(cfg, role)
    assert section.ulysses_sequence_parallel_size == 2
    assert ranks_per_dp_replica(section) == 2  # two consecutive ranks share one batch shard
    if role == "actor_rollout_ref.actor":  # the reference runs in the actor's layout
        assert cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2
    # the deprecated role key set to the same size is not a conflict; another size is
    compose_config("ppo_trainer", [*packed, f"{key}=2", f"{role}.ulysses_sequence_parallel_size=2"])
    with pytest.raises(ConfigValidationError, match=rf"{key}.*is 4 but `{role}.ulysses_sequence_parallel_size` is 2"):
        compose_config("ppo_trainer", [*packed, f"{key}=4", f"{role}.ulysses_sequence_parallel_size=2"])


def test_engine_section_size_needs_packing_like_the_role_key(valid_overrides):
    with pytest.raises(ConfigValidationError, match="ulysses_sequence_parallel_size` is 2 but sequence parallelism"):
        compose_config("ppo_trainer", [*valid_overrides, "actor_rollout_ref.model.use_remove_padding=false",
                                       "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"])
