"""``*.megatron.override_transformer_config.*`` and ``override_ddp_config.*`` are free-form as upstream: any field of
megatron-core's TransformerConfig / DistributedDataParallelConfig is accepted and reaches the config the engine
builds, and anything else is refused by name before a worker starts. On this CPU machine megatron-core cannot be
imported, so the field list is the one generated from its source (mcore_config_fields.txt); where it is
importable the live dataclasses answer, and the file must agree with them."""

from __future__ import annotations

import importlib.util

import pytest
from omegaconf import OmegaConf

from verl.trainer.config.checks import compose_config
from verl.workers.engine.megatron.config_fields import _FIELDS_FILE as FIELDS_FILE
from verl.workers.engine.megatron.config_fields import DDP_CONFIG, TRANSFORMER_CONFIG, _from_file, config_fields
from verl.workers.engine.megatron.settings import read_settings
from verl.workers.engine.megatron.validation import megatron_problems

A = "actor_rollout_ref.actor.megatron"
R = "actor_rollout_ref.ref.megatron"
C = "critic.megatron"
KL = ["actor_rollout_ref.actor.use_kl_loss=true", "critic.enable=true"]  # the ref and the critic are in use


def _cfg(*overrides):
    cfg = compose_config("ppo_megatron_trainer", [*KL, *overrides], validate=False)
    OmegaConf.resolve(cfg)
    return cfg


def _settings(cfg, prefix):
    return read_settings(OmegaConf.select(cfg, prefix), prefix=prefix)


@pytest.fixture(scope="module")
def tiny_qwen35():
    import transformers as tf

    from verl.models.qwen3_5.tiny import tiny_text_config_kwargs

    return tf.Qwen3_5TextConfig(**tiny_text_config_kwargs())


@pytest.mark.parametrize("prefix, field, value, text", [
    (A, "gradient_accumulation_fusion", False, "False"), (R, "gradient_accumulation_fusion", False, "False"),
    (C, "gradient_accumulation_fusion", False, "False"), (A, "moe_router_load_balancing_type", "none", "none"),
    (A, "apply_rope_fusion", False, "False")])
def test_any_transformer_config_field_reaches_the_engines_config(prefix, field, value, text, tiny_qwen35):
    from verl.models.mcore import registry

    cfg = _cfg(f"+{prefix}.override_transformer_config.{field}={text}")
    assert not [p for p in megatron_problems(cfg) if "override_transformer_config" in p]
    overrides = _settings(cfg, prefix).override_transformer_config
    assert overrides[field] == value
    # what the engine hands to megatron-core's TransformerConfig (the pure half of hf_to_mcore_config)
    assert registry.transformer_config_kwargs(tiny_qwen35, None, **overrides)[field] == value
    without = _settings(_cfg(), prefix).override_transformer_config
    assert field not in without


def test_plus_on_the_refs_inherited_mapping_replaces_it_as_hydra_does():
    cfg = _cfg(f"+{R}.override_transformer_config.gradient_accumulation_fusion=False")
    assert OmegaConf.to_container(OmegaConf.select(cfg, f"{R}.override_transformer_config")) == {
        "gradient_accumulation_fusion": False}
    assert "gradient_accumulation_fusion" not in OmegaConf.select(cfg, f"{A}.override_transformer_config")


@pytest.mark.parametrize("prefix", [A, R, C])
def test_unknown_transformer_field_is_refused_by_name(prefix):
    cfg = _cfg(f"+{prefix}.override_transformer_config.use_flash_attn=True",
               f"+{prefix}.override_transformer_config.recompute_granularty=full")
    problems = megatron_problems(cfg)
    assert any(f"{prefix}.override_transformer_config.use_flash_attn" in p and "attention_backend" in p
               for p in problems)
    assert any(f"{prefix}.override_transformer_config.recompute_granularty" in p and "recompute_granularity" in p
               for p in problems)
    with pytest.raises(ValueError, match=f"{prefix}.override_transformer_config.use_flash_attn"):
        _settings(cfg, prefix)  # the engine refuses it too


@pytest.mark.parametrize("prefix", [A, C])
def test_ddp_config_fields(prefix):
    cfg = _cfg(f"+{prefix}.override_ddp_config.grad_reduce_in_fp32=False", f"+{prefix}.override_ddp_config.bucket_size=7")
    assert _settings(cfg, prefix).override_ddp_config == {"grad_reduce_in_fp32": False, "bucket_size": 7}
    bad = _cfg(f"+{prefix}.override_ddp_config.bucket_sizee=7")
    assert any(f"{prefix}.override_ddp_config.bucket_sizee" in p and "bucket_size" in p for p in megatron_problems(bad))


def test_field_list_is_megatron_cores():
    listed = _from_file()
    assert {"gradient_accumulation_fusion", "recompute_granularity", "tensor_model_parallel_size"} <= \
        listed[TRANSFORMER_CONFIG]  # TransformerConfig's own fields and those it inherits (ModelParallelConfig)
    assert {"grad_reduce_in_fp32", "bucket_size"} <= listed[DDP_CONFIG]
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core not importable: the live comparison runs where it is")
    import megatron.core

    header = FIELDS_FILE.read_text().splitlines()[0]
    if f" {megatron.core.__version__}," not in header:
        pytest.skip(f"the list is of another megatron-core ({header}); rerun scripts/mcore_config_fields.py")
    assert config_fields(TRANSFORMER_CONFIG) == listed[TRANSFORMER_CONFIG]
    assert config_fields(DDP_CONFIG) == listed[DDP_CONFIG]
