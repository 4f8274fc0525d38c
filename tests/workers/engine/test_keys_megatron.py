"""Every role's ``*.megatron`` keys become the Megatron engine's settings.

The Megatron engine reads its section once, through :func:`read_settings`, and builds the parallel state,
model, DDP wrapper and offload schedule from the resulting :class:`MegatronSettings` (megatron-core is not
installed on the CPU runners; test_megatron_engine_gpu.py runs the engine itself). Here each key is changed
on the command line of ``ppo_megatron_trainer``, the role's section is read the way the engine reads it
(with the engine's key prefix, so errors name the key), and the setting it becomes is checked. The key
names are spelled out so key_status.txt can point here.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from verl.trainer.config.checks import compose_config
from verl.workers.engine.megatron.settings import read_settings


def _settings(key: str, value, *extra: str):
    cfg = compose_config("ppo_megatron_trainer", [f"{key}={value}", *extra], validate=False)
    OmegaConf.resolve(cfg)
    prefix = key.lstrip("+").split(".megatron.")[0] + ".megatron"
    model = "critic.model" if prefix.startswith("critic") else "actor_rollout_ref.model"
    return read_settings(OmegaConf.select(cfg, prefix), OmegaConf.select(cfg, f"{model}.use_remove_padding"),
                         prefix=prefix)


# (key, value, settings field, expected); the ref's parallel layout, offload and seed follow the actor's
CASES = [
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 4, "tp", 4),
    ("critic.megatron.tensor_model_parallel_size", 4, "tp", 4),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", 2, "pp", 2),
    ("critic.megatron.pipeline_model_parallel_size", 2, "pp", 2),
    ("actor_rollout_ref.actor.megatron.expert_model_parallel_size", 2, "ep", 2),
    ("critic.megatron.expert_model_parallel_size", 2, "ep", 2),
    ("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size", 1, "etp", 1),
    ("critic.megatron.expert_tensor_parallel_size", 1, "etp", 1),
    ("actor_rollout_ref.actor.megatron.context_parallel_size", 2, "cp", 2),
    ("actor_rollout_ref.ref.megatron.context_parallel_size", 2, "cp", 2),
    ("critic.megatron.context_parallel_size", 2, "cp", 2),
    ("actor_rollout_ref.actor.megatron.use_distributed_optimizer", False, "use_distributed_optimizer", False),
    ("critic.megatron.use_distributed_optimizer", False, "use_distributed_optimizer", False),
    ("actor_rollout_ref.actor.megatron.param_offload", True, "param_offload", True),
    ("critic.megatron.param_offload", True, "param_offload", True),
    ("actor_rollout_ref.actor.megatron.grad_offload", True, "grad_offload", True),
    ("critic.megatron.grad_offload", True, "grad_offload", True),
    ("actor_rollout_ref.actor.megatron.optimizer_offload", True, "optimizer_offload", True),
    ("critic.megatron.optimizer_offload", True, "optimizer_offload", True),
    ("actor_rollout_ref.actor.megatron.forward_only", True, "forward_only", True),
    ("critic.megatron.forward_only", True, "forward_only", True),
    ("actor_rollout_ref.actor.megatron.dtype", "float32", "dtype", "float32"),
    ("actor_rollout_ref.ref.megatron.dtype", "float32", "dtype", "float32"),
    ("critic.megatron.dtype", "fp32", "dtype", "float32"),
    ("actor_rollout_ref.actor.megatron.seed", 7, "seed", 7),
    ("critic.megatron.seed", 7, "seed", 7),
    ("actor_rollout_ref.actor.megatron.use_remove_padding", False, "use_remove_padding", False),
    ("critic.megatron.use_remove_padding", False, "use_remove_padding", False),
    ("actor_rollout_ref.actor.megatron.override_ddp_config", "{bucket_size:1024}", "override_ddp_config",
     {"bucket_size": 1024}),
    ("critic.megatron.override_ddp_config", "{bucket_size:1024}", "override_ddp_config", {"bucket_size": 1024}),
]


@pytest.mark.parametrize("key, value, field, expected", CASES, ids=[c[0] for c in CASES])
def test_key_becomes_the_setting(key, value, field, expected):
    default = getattr(_settings(key.rsplit(".", 1)[0] + ".dtype", "bfloat16"), field)
    assert default != expected  # the default differs, so the change is the key's doing
    prefix = "++" if field == "override_ddp_config" else ""  # an empty mapping in the YAML
    assert getattr(_settings(prefix + key, value), field) == expected


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                                 "critic.megatron.tensor_model_parallel_size"])
def test_sequence_parallel_applies_from_tp_2(key):
    sp_key = key.rsplit(".", 1)[0] + ".sequence_parallel"
    assert _settings(key, 2).sequence_parallel is True
    assert _settings(key, 2, f"{sp_key}=false").sequence_parallel is False
    assert _settings(key, 1).sequence_parallel is False  # meaningless at TP 1 (megatron-core rejects it)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.megatron.sequence_parallel",
                                 "actor_rollout_ref.ref.megatron.sequence_parallel",
                                 "critic.megatron.sequence_parallel"])
def test_sequence_parallel_off(key):
    tp = key.rsplit(".", 1)[0] + ".tensor_model_parallel_size"
    assert _settings(key, False, f"{tp}=2").sequence_parallel is False
    assert _settings(key, True, f"{tp}=2").sequence_parallel is True


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
                                 "critic.megatron.virtual_pipeline_model_parallel_size"])
def test_virtual_pipeline_needs_a_pipeline(key):
    pp = key.rsplit(".", 1)[0] + ".pipeline_model_parallel_size"
    assert _settings(key, 2, f"{pp}=2").vpp == 2
    with pytest.raises(ValueError, match=key):
        _settings(key, 2)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.megatron.use_dist_checkpointing",
                                 "actor_rollout_ref.ref.megatron.use_dist_checkpointing",
                                 "critic.megatron.use_dist_checkpointing"])
def test_dist_checkpointing_path_is_read_when_use_dist_checkpointing(key, tmp_path):
    path_key = key.rsplit(".", 1)[0] + ".dist_checkpointing_path"
    s = _settings(key, True, f"{path_key}={tmp_path}")
    assert s.use_dist_checkpointing is True and s.dist_checkpointing_path == str(tmp_path)
    with pytest.raises(ValueError, match=path_key):  # a path without the switch is a mistake, named
        _settings(key, False, f"{path_key}={tmp_path}")


def test_dist_checkpointing_path_names():
    for key in ("actor_rollout_ref.actor.megatron.dist_checkpointing_path",
                "actor_rollout_ref.ref.megatron.dist_checkpointing_path", "critic.megatron.dist_checkpointing_path"):
        use = key.rsplit(".", 1)[0] + ".use_dist_checkpointing"
        assert _settings(key, "/ckpt/x", f"{use}=true").dist_checkpointing_path == "/ckpt/x"


@pytest.mark.parametrize("key, value", [
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity", "full"),
    ("critic.megatron.override_transformer_config.recompute_granularity", "full"),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method", "uniform"),
    ("critic.megatron.override_transformer_config.recompute_method", "uniform"),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers", 2),
    ("critic.megatron.override_transformer_config.recompute_num_layers", 2),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_modules", "[mlp]"),
    ("critic.megatron.override_transformer_config.recompute_modules", "[mlp]"),
    # the engine turns the name into megatron-core's AttnBackend (a Transformer Engine kernel choice)
    ("actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend", "local"),
    ("critic.megatron.override_transformer_config.attention_backend", "local"),
])
def test_override_transformer_config_entries_reach_the_transformer_config(key, value):
    field = key.rsplit(".", 1)[1]
    got = _settings(key, value).override_transformer_config[field]
    assert got == (["mlp"] if value == "[mlp]" else value)
    if key.startswith("actor_rollout_ref.actor"):  # the reference's section follows the actor's
        ref = _settings(key, value, "actor_rollout_ref.ref.megatron.dtype=bfloat16")
        assert ref.override_transformer_config[field] == got


def test_the_reference_follows_the_actors_layout():
    cfg = compose_config("ppo_megatron_trainer", ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                                  "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                                  "actor_rollout_ref.actor.megatron.param_offload=true",
                                                  "actor_rollout_ref.actor.megatron.seed=9"], validate=False)
    OmegaConf.resolve(cfg)
    s = read_settings(cfg.actor_rollout_ref.ref.megatron, prefix="actor_rollout_ref.ref.megatron")
    assert (s.tp, s.pp, s.param_offload, s.seed, s.forward_only) == (2, 2, True, 9, True)
