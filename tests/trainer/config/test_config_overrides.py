"""check_overrides: unknown keys are rejected with a useful hint, valid forms pass."""

import pytest

from verl.trainer.config import ConfigKeyError, check_overrides, compose_config
from verl.trainer.config.checks import split_overrides, upstream_only_keys


def _error(cfg, overrides):
    with pytest.raises(ConfigKeyError) as info:
        check_overrides(cfg, overrides)
    return info.value


def test_existing_keys_and_list_values_pass(base_cfg):
    check_overrides(base_cfg, [
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "trainer.logger=[console,wandb]",
        "data.train_files=[a.parquet,b.parquet]",
        "trainer.experiment_name='my run'",
        "actor_rollout_ref.model.model_type=qwen3_5_text",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512",
        "trainer.launcher=local",
        "hydra.run.dir=/tmp/x",  # Hydra's own keys are Hydra's business
        "model_engine=megatron",  # a config-group choice, not a value
    ])


def test_typo_suggests_sibling(base_cfg):
    err = _error(base_cfg, ["actor_rollout_ref.actor.optim.lrr=1"])
    assert "`actor_rollout_ref.actor.optim.lrr`" in str(err)
    assert "Did you mean `actor_rollout_ref.actor.optim.lr`" in str(err)


def test_typo_in_middle_component_is_fixed(base_cfg):
    err = _error(base_cfg, ["actor_rollout_ref.actr.ppo_epochs=2"])
    assert "`actor_rollout_ref.actor.ppo_epochs`" in str(err)


def test_key_in_wrong_section_suggests_real_location(base_cfg):
    err = _error(base_cfg, ["actor_rollout_ref.ppo_mini_batch_size=2"])
    assert "`actor_rollout_ref.actor.ppo_mini_batch_size`" in str(err)


def test_upstream_only_key_is_named_as_such(base_cfg):
    assert "actor_rollout_ref.rollout.prometheus.enable" in upstream_only_keys()
    err = _error(base_cfg, ["global_profiler.global_tool_config.nsys.discrete=true",
                            "actor_rollout_ref.rollout.prometheus.enable=true"])
    assert len(err.problems) == 2
    for problem in err.problems:
        assert "upstream verl option this project does not implement" in problem


def test_key_inside_dropped_upstream_subtree(base_cfg):
    err = _error(base_cfg, ["+actor_rollout_ref.rollout.engine_kwargs.trtllm.foo=1"])
    assert "TRT-LLM rollout engine, which this project does not implement" in str(err)


def test_legacy_keys_point_to_new_home(base_cfg):
    err = _error(base_cfg, ["reward_model.reward_manager=prime", "critic.model.fsdp_config.param_offload=true"])
    assert "`reward.reward_manager.name`" in err.problems[0]
    assert "`critic.fsdp.param_offload`" in err.problems[1]


def test_megatron_key_with_dp_engine_hints_engine_switch(base_cfg):
    err = _error(base_cfg, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    assert "model_engine=megatron" in str(err)


def test_plus_into_open_dict_is_allowed(base_cfg):
    check_overrides(base_cfg, [
        "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
        "+ray_kwargs.ray_init.runtime_env.env_vars.TOKENIZERS_PARALLELISM=false",
        "+data.apply_chat_template_kwargs.enable_thinking=false",
        "++critic.model.override_config.foo=1",
        # a key added by an earlier `+` may be set again later in the same list
        "data.apply_chat_template_kwargs.enable_thinking=true",
    ])


def test_plus_outside_open_dict_is_rejected(base_cfg):
    err = _error(base_cfg, ["+actor_rollout_ref.actor.new_knob=1", "++trainer.new_knob=1"])
    assert len(err.problems) == 2
    assert "`+` may only add keys below free-form nodes" in err.problems[0]


def test_plus_on_existing_key_says_drop_the_plus(base_cfg):
    err = _error(base_cfg, ["+trainer.total_epochs=3"])
    assert "no leading `+`" in str(err)


def test_plain_set_inside_open_dict_suggests_plus(base_cfg):
    err = _error(base_cfg, ["actor_rollout_ref.model.override_config.attention_dropout=0.0"])
    assert "`+actor_rollout_ref.model.override_config.attention_dropout=0.0`" in str(err)


def test_force_add_existing_and_delete(base_cfg):
    check_overrides(base_cfg, ["++trainer.total_epochs=2", "~trainer.rollout_data_dir"])
    err = _error(base_cfg, ["~trainer.nope"])
    assert "cannot delete `trainer.nope`" in str(err)


def test_all_problems_reported_together(base_cfg):
    err = _error(base_cfg, ["trainer.total_epoch=1", "data.max_promt_length=3", "trainer.nnodes=1"])
    assert len(err.problems) == 2
    assert "`trainer.total_epochs`" in err.problems[0]
    assert "`data.max_prompt_length`" in err.problems[1]
    assert isinstance(err, ValueError)


def test_unparseable_override(base_cfg):
    with pytest.raises(ConfigKeyError, match="could not parse"):
        check_overrides(base_cfg, ["trainer.logger=[unclosed"])


def test_split_overrides():
    groups, values = split_overrides(
        ["model_engine=megatron", "trainer.nnodes=2", "actor@actor_rollout_ref.actor=dp_actor"]
    )
    assert groups == ["model_engine=megatron", "actor@actor_rollout_ref.actor=dp_actor"]
    assert values == ["trainer.nnodes=2"]


def test_compose_config_checks_against_selected_engine():
    # A megatron key is valid once the engine group is switched in the same command line.
    cfg = compose_config(overrides=["model_engine=megatron",
                                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], validate=False)
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    with pytest.raises(ConfigKeyError, match="actor_rollout_ref.actor.fsdp_config.param_offload"):
        compose_config(overrides=["model_engine=megatron", "actor_rollout_ref.actor.fsdp_config.param_offload=true"],
                       validate=False)
