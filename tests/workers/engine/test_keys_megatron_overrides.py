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
    cfg = _cfg(f"+{prefix}.override_transformer_config.use_triton_gdn=True",
               f"+{prefix}.override_transformer_config.recompute_granularty=full")
    problems = megatron_problems(cfg)
    assert any(f"{prefix}.override_transformer_config.use_triton_gdn" in p and "MindSpeed" in p for p in problems)
    assert any(f"{prefix}.override_transformer_config.recompute_granularty" in p and "recompute_granularity" in p
               for p in problems)
    with pytest.raises(ValueError, match=f"{prefix}.override_transformer_config.use_triton_gdn"):
        _settings(cfg, prefix)  # the engine refuses it too


@pytest.mark.parametrize("prefix", [A, R, C])
def test_mindspeed_keys_of_upstreams_qwen3_5_scripts_reach_the_model(prefix, tiny_qwen35):
    """use_naive_l2norm / use_flash_attn are not megatron-core fields; upstream's Qwen3.5 Megatron scripts set both.
    They pass validation and arrive on the config the model reads (megatron-core keeps them off its dataclass)."""
    from verl.models.mcore import registry
    from verl.models.mcore.config_converter import EXTRA_MODEL_KEYS

    cfg = _cfg(f"+{prefix}.override_transformer_config.use_naive_l2norm=True",
               f"+{prefix}.override_transformer_config.use_flash_attn=True")
    assert not [p for p in megatron_problems(cfg) if "override_transformer_config" in p]
    overrides = _settings(cfg, prefix).override_transformer_config
    kwargs = registry.transformer_config_kwargs(tiny_qwen35, None, **overrides)
    assert kwargs["use_naive_l2norm"] is True and kwargs["use_flash_attn"] is True
    assert {"use_naive_l2norm", "use_flash_attn"} <= set(EXTRA_MODEL_KEYS)
    assert not {"use_naive_l2norm", "use_flash_attn"} & config_fields(TRANSFORMER_CONFIG)


def test_naive_l2norm_moves_the_norm_out_of_the_kernel():
    import torch

    from verl.models.qwen3_5.gated_deltanet import gated_delta_rule, prenormalize_qk

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g) for _ in range(3))
    gl, beta = -torch.rand(1, 40, 2, generator=g) * 0.5, torch.rand(1, 40, 2, generator=g)
    fused = prenormalize_qk(q, k, naive=False)
    assert fused[2] is True and fused[0] is q and fused[1] is k  # the kernel normalises
    qn, kn, in_kernel = prenormalize_qk(q, k, naive=True)
    assert in_kernel is False
    torch.testing.assert_close(qn.norm(dim=-1), torch.ones(1, 40, 2), atol=1e-5, rtol=0)
    assert not torch.allclose(qn, q)
    # the same delta rule either way, to rounding
    torch.testing.assert_close(gated_delta_rule(qn, kn, v, gl, beta, use_qk_l2norm=False),
                               gated_delta_rule(q, k, v, gl, beta, use_qk_l2norm=True), atol=1e-5, rtol=1e-5)


def test_inert_mindspeed_keys_are_said_not_silent(caplog, tiny_qwen35):
    import logging

    import transformers as tf

    from verl.workers.engine.megatron.engine import _warn_inert_extras

    with caplog.at_level(logging.WARNING):
        _warn_inert_extras({"use_naive_l2norm": True}, tiny_qwen35, A)
    assert not caplog.records  # Qwen3.5 has Gated DeltaNet layers: the key applies
    with caplog.at_level(logging.WARNING):
        _warn_inert_extras({"use_flash_attn": True}, tiny_qwen35, A)
        _warn_inert_extras({"use_naive_l2norm": True}, tf.Qwen3Config(num_hidden_layers=1, hidden_size=32,
                                                                       num_attention_heads=2, intermediate_size=64,
                                                                       vocab_size=64), A)
    text = caplog.text
    assert f"{A}.override_transformer_config.use_flash_attn=true changes nothing" in text
    assert "use_naive_l2norm=true changes nothing for Qwen3Config" in text


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
