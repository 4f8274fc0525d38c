"""Shared fixtures: composing with Hydra is slow-ish, so compose once per module."""

import copy

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl.trainer.config import CONFIG_DIR


def compose_cfg(name="ppo_trainer", overrides=()):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


# A small, self-consistent setup (2 ranks, GAE with a critic) that must validate cleanly;
# the validation tests break one thing at a time on top of it.
VALID_OVERRIDES = [
    "actor_rollout_ref.rollout.name=hf",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
]


@pytest.fixture(scope="session")
def valid_overrides():
    return list(VALID_OVERRIDES)


@pytest.fixture(scope="session")
def compose_fn():
    """Tests import nothing from conftest (tests/ is not a package); they take this fixture."""
    return compose_cfg


@pytest.fixture(scope="session")
def base_cfg():
    return compose_cfg()


@pytest.fixture(scope="session")
def megatron_cfg():
    return compose_cfg("ppo_megatron_trainer")


@pytest.fixture(scope="session")
def _valid_cfg():
    return compose_cfg(overrides=VALID_OVERRIDES)


@pytest.fixture
def valid_cfg(_valid_cfg):
    # Tests mutate the config; hand each one its own copy.
    cfg = copy.deepcopy(_valid_cfg)
    OmegaConf.set_struct(cfg, False)
    return cfg
