"""`+key=value` on a key that already exists behaves exactly as in Hydra 1.3 (issue 16 item 1).

Hydra applies it when the current value is null (``???`` included) or when the new value is a list or dict
(merged, force_add), and raises "Could not append to config" otherwise. Each case is composed twice: once by
the real Hydra installed here (plain ``compose``, no checks of ours) and once through ``compose_config``.
Where Hydra composes, ours must compose to the same config; where Hydra refuses, our key check must refuse
first, with its own message naming the key (not by letting Hydra's exception through).
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from verl.trainer.config import CONFIG_DIR, ConfigKeyError, compose_config

OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"
CASES = [
    # (config name, overrides, does Hydra apply it?)
    ("ppo_trainer", ["+trainer.logger=[console]"], True),  # list onto a list: replaced
    ("ppo_trainer", ["+ray_kwargs.ray_init={num_cpus: 4}"], True),  # dict onto a dict: merged, runtime_env kept
    ("ppo_trainer", ["+trainer.project_name={a: 1}"], True),  # dict onto a string
    ("ppo_trainer", ["+trainer.nnodes=[1]"], True),  # list onto an int
    ("ppo_trainer", ["+trainer.total_training_steps=5"], True),  # null
    ("ppo_trainer", ["+actor_rollout_ref.rollout.name=hf"], True),  # ??? selects as null
    ("ppo_trainer", ["+critic.ppo_micro_batch_size_per_gpu=2"], True),  # interpolation resolving to null
    ("ppo_trainer", ["trainer.total_epochs=null", "+trainer.total_epochs=3"], True),  # nulled by an earlier one
    ("ppo_trainer", ["~trainer.total_epochs", "+trainer.total_epochs=3"], True),  # deleted by an earlier one
    ("ppo_megatron_trainer", [f"+{OTC}.recompute_modules=[core_attn,mlp]"], True),
    ("ppo_megatron_trainer", [f"+{OTC}.recompute_method=uniform", f"+{OTC}.recompute_num_layers=1"], True),
    # the ref's override_transformer_config inherits the actor's (an interpolation): `+` replaces it
    ("ppo_megatron_trainer", ["+actor_rollout_ref.ref.megatron.override_transformer_config.apply_rope_fusion=False"],
     True),
    ("ppo_trainer", ["+actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"], False),  # upstream scripts' `+`
    ("ppo_trainer", ["+trainer.total_epochs=3"], False),  # a scalar onto a set scalar
    ("ppo_trainer", ["+trainer.logger=console"], False),  # a scalar onto a list
    ("ppo_trainer", ["+trainer.logger=null"], False),  # null is a scalar too
    ("ppo_trainer", ["+critic.loss_agg_mode=seq-mean-token-sum"], False),  # interpolation resolving to a value
    ("ppo_trainer", ["trainer.total_training_steps=7", "+trainer.total_training_steps=5"], False),  # set earlier
    ("ppo_megatron_trainer", [f"+{OTC}.attention_backend=fused"], False),
]


def _hydra(name, overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        try:
            return OmegaConf.to_container(compose(config_name=name, overrides=overrides), resolve=False)
        except ConfigCompositionException as err:
            assert "Could not append to config" in str(err)  # the rule under test, not some other failure
            return None


@pytest.mark.parametrize("name, overrides, applies", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_plus_on_existing_key_matches_hydra(name, overrides, applies):
    expected = _hydra(name, overrides)
    assert (expected is not None) == applies  # the table states what Hydra does; check it still does
    if applies:
        ours = compose_config(name, overrides, validate=False)
        assert OmegaConf.to_container(ours, resolve=False) == expected
    else:
        with pytest.raises(ConfigKeyError) as info:
            compose_config(name, overrides, validate=False)
        key = overrides[-1].lstrip("+").split("=")[0]
        assert f"`{key}` already exists" in str(info.value) and "Could not append to config" in str(info.value)


def test_merged_dict_keeps_existing_entries():
    # Hydra merges a dict given with `+` into the existing node instead of replacing it.
    cfg = compose_config("ppo_trainer", ["+ray_kwargs.ray_init={num_cpus: 4}"], validate=False)
    assert cfg.ray_kwargs.ray_init.num_cpus == 4 and "runtime_env" in cfg.ray_kwargs.ray_init
