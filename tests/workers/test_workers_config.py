"""verl.workers.config: the actor dataclasses come from the YAML and are what policy losses receive."""

import dataclasses

import pytest
import yaml
import torch
from omegaconf import OmegaConf, open_dict

from verl.trainer.config.checks import compose_config
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, CheckpointConfig, FSDPActorConfig, FSDPEngineConfig, \
    FSDPOptimizerConfig, McoreActorConfig, McoreCheckpointConfig, McoreEngineConfig, McoreOptimizerConfig, \
    OptimizerConfig, PolicyLossConfig, ProfilerConfig, actor_config_from_omegaconf

ACTOR_YAML = "verl/trainer/config/actor/actor.yaml"


def test_fields_and_defaults_are_the_yamls():
    raw = OmegaConf.load(ACTOR_YAML)
    pl = PolicyLossConfig()
    for key, value in raw.policy_loss.items():
        assert pl[key] == value
    names = {f.name for f in dataclasses.fields(ActorConfig)}
    assert set(raw.keys()) - {"defaults"} <= names
    assert ActorConfig().clip_ratio_c == raw.clip_ratio_c


def test_frozen_except_global_batch_info_and_mapping_access():
    cfg = ActorConfig(clip_ratio=0.3)
    assert cfg.get("clip_ratio") == 0.3 and cfg["clip_ratio"] == 0.3 and cfg.get("nope", 1) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_ratio = 0.1
    cfg.global_batch_info = {"dp_size": 2}
    assert dict(cfg)["global_batch_info"] == {"dp_size": 2}


def test_built_from_the_composed_config():
    base = compose_config("ppo_trainer", ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                                          "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], validate=False)
    cfg = actor_config_from_omegaconf(base.actor_rollout_ref.actor, {"dp_size": 1})
    assert isinstance(cfg, FSDPActorConfig) and isinstance(cfg, ActorConfig)
    assert cfg.clip_ratio_high == 0.28 and cfg.policy_loss.loss_mode == "gspo"
    assert cfg.global_batch_info == {"dp_size": 1}
    assert cfg.optim["lr"] == base.actor_rollout_ref.actor.optim.lr  # mapping access still works
    mcore = compose_config("ppo_megatron_trainer", ["actor_rollout_ref.rollout.name=hf"], validate=False)
    assert isinstance(actor_config_from_omegaconf(mcore.actor_rollout_ref.actor), McoreActorConfig)


def test_unknown_policy_loss_key_is_refused():
    with pytest.raises(ValueError, match="PolicyLossConfig does not declare"):
        actor_config_from_omegaconf({"strategy": "fsdp", "policy_loss": {"loss_mode": "vanilla", "foo": 1}})


def test_the_actor_hands_custom_policy_losses_an_actor_config(tmp_path):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.protocol import DataProto
    from verl.workers.actor.ppo_actor import PPOActor
    from tests.engine_utils import arr_config, make_engine, sgd, single_rank_gloo
    from tests.workers.actor.test_dp_parity import make_batch

    seen = []

    @core_algos.register_policy_loss("test_records_config")
    def _loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
              rollout_is_weights=None):
        seen.append(config)
        return -(log_prob * advantages * response_mask).sum() / response_mask.sum(), {}

    build_tiny_qwen3_5(str(tmp_path), kind="dense", seed=0)
    try:
        cfg = arr_config(str(tmp_path))
        with open_dict(cfg):
            cfg.actor.ppo_mini_batch_size = 8
            cfg.actor.ppo_micro_batch_size_per_gpu = 4
            cfg.actor.policy_loss.loss_mode = "test_records_config"
        with single_rank_gloo():
            engine = make_engine(sgd(cfg.actor, lr=0.1), cfg.model, "actor")
            PPOActor(cfg.actor, engine).update_policy(
                DataProto.from_dict(tensors=make_batch(), meta_info={"temperature": 1.0}))
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("test_records_config", None)
    assert seen and all(isinstance(c, ActorConfig) for c in seen)
    assert seen[0].global_batch_info["batch_num_tokens"] > 0 and seen[0].policy_loss.loss_mode == "test_records_config"


CONFIG = "verl/trainer/config/"


@pytest.mark.parametrize("cls, yaml_file", [
    (FSDPOptimizerConfig, "optim/fsdp.yaml"), (McoreOptimizerConfig, "optim/megatron.yaml"),
    (FSDPEngineConfig, "engine/fsdp.yaml"), (McoreEngineConfig, "engine/megatron.yaml"),
    (ProfilerConfig, "profiler/profiler.yaml"),
])
def test_section_classes_are_their_yaml(cls, yaml_file):
    """One field per YAML key, with the YAML's default; so a key added to the YAML is a field here."""
    raw = OmegaConf.load(CONFIG + yaml_file)
    assert {f.name for f in dataclasses.fields(cls)} == set(raw.keys())
    obj = cls()
    for key in raw.keys():
        value = raw[key]
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if isinstance(value, str) and value.startswith("${oc.select:"):  # outside the composed config: the fallback
            continue
        assert obj[key] == _fallbacks(value), key


def _fallbacks(value):
    """Nested ``${oc.select:key,default}`` values read as their default (what the dataclass holds)."""
    if isinstance(value, dict):
        return {k: _fallbacks(v) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("${oc.select:"):
        return yaml.safe_load(value[len("${oc.select:"):-1].split(",", 1)[1])
    return value


def test_checkpoint_defaults_follow_the_yaml_interpolation():
    # load_contents is ``${.save_contents}`` in actor.yaml: the default follows save_contents, as upstream's does.
    raw = OmegaConf.load(ACTOR_YAML)
    assert CheckpointConfig().load_contents == CheckpointConfig().save_contents == list(raw.checkpoint.save_contents)
    assert McoreCheckpointConfig().mbridge_config == {} and issubclass(McoreCheckpointConfig, CheckpointConfig)
    assert ProfilerConfig().save_path == "outputs/profile"  # the oc.select fallback, not None


@pytest.mark.parametrize("trainer, actor_cls, optim_cls, engine_key, engine_cls, ckpt_cls", [
    ("ppo_trainer", FSDPActorConfig, FSDPOptimizerConfig, "fsdp_config", FSDPEngineConfig, CheckpointConfig),
    ("ppo_megatron_trainer", McoreActorConfig, McoreOptimizerConfig, "megatron", McoreEngineConfig,
     McoreCheckpointConfig),
])
def test_nested_sections_have_attribute_access(trainer, actor_cls, optim_cls, engine_key, engine_cls, ckpt_cls):
    """Upstream's ``cfg.optim.lr`` / ``cfg.checkpoint.save_contents``: typed sections carrying the composed
    values (overrides included), not plain dicts."""
    base = compose_config(trainer, ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.optim.lr=3e-5",
                                    "actor_rollout_ref.actor.checkpoint.save_contents=[model]",
                                    "actor_rollout_ref.actor.optim.weight_decay=0.05"], validate=False)
    cfg = actor_config_from_omegaconf(base.actor_rollout_ref.actor)
    assert type(cfg) is actor_cls
    assert type(cfg.optim) is optim_cls and isinstance(cfg.optim, OptimizerConfig)
    assert cfg.optim.lr == 3e-5 and cfg.optim.weight_decay == 0.05
    assert type(cfg.checkpoint) is ckpt_cls and cfg.checkpoint.save_contents == ["model"]
    # The composed load_contents interpolates save_contents; the typed section keeps the resolved value.
    assert cfg.checkpoint.load_contents == ["model"]
    assert type(cfg.profiler) is ProfilerConfig and cfg.profiler.enable is False
    engine = cfg[engine_key]
    assert type(engine) is engine_cls
    composed = OmegaConf.to_container(base.actor_rollout_ref.actor[engine_key], resolve=True)
    assert dict(engine) == composed
    assert cfg.extra == {}  # every composed key landed in a declared field
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0


def test_unknown_key_in_a_nested_section_is_refused_by_name():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.optim has keys \['foo'\].*FSDPOptimizerConfig"):
        actor_config_from_omegaconf({"strategy": "fsdp", "optim": {"lr": 1e-5, "foo": 1}})
    with pytest.raises(ValueError, match="must be a mapping"):
        actor_config_from_omegaconf({"strategy": "fsdp", "checkpoint": ["model"]})


def test_typed_sections_survive_pickling():
    """Ray pickles the config; the generated classes must be importable by their module and name."""
    import pickle

    cfg = actor_config_from_omegaconf({"strategy": "fsdp", "optim": {"lr": 2e-6}, "checkpoint": {"async_save": True}})
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and type(back.optim) is FSDPOptimizerConfig and back.optim.lr == 2e-6
    assert back.checkpoint.async_save is True
