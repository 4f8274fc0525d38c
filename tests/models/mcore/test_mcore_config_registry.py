"""HF config -> megatron-core TransformerConfig kwargs, parallel-size checks and the mcore model registry
(pure: no megatron-core needed)."""

import pytest
import torch

from verl.models.mcore import registry as mreg
from verl.models.mcore.config_converter import check_parallel_sizes
from verl.models.qwen3_5.mcore.config import qwen3_5_transformer_config_kwargs
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5


@pytest.fixture(scope="module")
def configs():
    return {kind: build_tiny_qwen3_5(None, kind=kind, with_tokenizer=False).config
            for kind in ("dense", "moe", "vl", "vl_moe")}


def test_mcore_dense_config(configs):
    cfg = configs["dense"]
    kw = qwen3_5_transformer_config_kwargs(cfg, torch.bfloat16, tensor_model_parallel_size=2)
    assert kw["num_layers"] == 4 and kw["hidden_size"] == 64 and kw["ffn_hidden_size"] == 128
    assert kw["num_attention_heads"] == 4 and kw["num_query_groups"] == 2 and kw["kv_channels"] == 16
    assert kw["linear_attention_freq"] == [1, 1, 1, 0]
    assert (kw["linear_num_key_heads"], kw["linear_num_value_heads"]) == (2, 4)
    assert (kw["linear_key_head_dim"], kw["linear_value_head_dim"], kw["linear_conv_kernel_dim"]) == (16, 16, 4)
    assert kw["rotary_percent"] == 0.25 and kw["rotary_base"] == 10000.0
    assert kw["layernorm_zero_centered_gamma"] and kw["qk_layernorm"] and kw["attention_output_gate"]
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6 and kw["gated_linear_unit"]
    assert kw["bf16"] and kw["params_dtype"] == torch.bfloat16 and not kw["fp16"]
    assert kw["tensor_model_parallel_size"] == 2
    assert "num_moe_experts" not in kw


def test_mcore_moe_and_vl_configs(configs):
    moe = qwen3_5_transformer_config_kwargs(configs["moe"])
    assert moe["num_moe_experts"] == 4 and moe["moe_router_topk"] == 2 and moe["moe_ffn_hidden_size"] == 32
    assert moe["moe_shared_expert_intermediate_size"] == 32 and moe["moe_shared_expert_gate"]
    assert moe["moe_router_score_function"] == "softmax" and not moe["moe_router_pre_softmax"]
    # VL checkpoints convert from their text sub-config
    vl = qwen3_5_transformer_config_kwargs(configs["vl_moe"])
    assert vl["num_moe_experts"] == 4 and vl["hidden_size"] == 64 and vl["linear_attention_freq"] == [1, 1, 1, 0]
    assert "num_moe_experts" not in qwen3_5_transformer_config_kwargs(configs["vl"])


def test_mcore_config_refuses_architecture_overrides(configs):
    with pytest.raises(ValueError, match=r"override_transformer_config may not change \['num_layers'\]"):
        qwen3_5_transformer_config_kwargs(configs["dense"], num_layers=8)
    # a consistent value and non-architecture keys are fine
    kw = qwen3_5_transformer_config_kwargs(configs["dense"], num_layers=4, recompute_granularity="full")
    assert kw["recompute_granularity"] == "full"


def test_mcore_parallel_size_messages(configs):
    dense, moe = configs["dense"], configs["moe"]
    assert check_parallel_sizes(dense, tp=2, pp=2) == []
    assert check_parallel_sizes(moe, tp=2, pp=4, ep=4, sequence_parallel=True) == []
    msgs = check_parallel_sizes(dense, tp=8)
    assert any("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8 does not divide num_attention_heads"
               in m for m in msgs)
    assert any("num_key_value_heads" in m for m in msgs) and any("linear_num_key_heads" in m for m in msgs)
    (m,) = check_parallel_sizes(dense, pp=3)
    assert "pipeline_model_parallel_size" in m and "num_hidden_layers (4)" in m
    (m,) = check_parallel_sizes(dense, pp=2, vpp=4)
    assert m.startswith("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size")
    (m,) = check_parallel_sizes(moe, ep=3)
    assert "expert_model_parallel_size=3 does not divide num_experts (4)" in m
    (m,) = check_parallel_sizes(dense, ep=2)
    assert "needs a MoE model" in m
    (m,) = check_parallel_sizes(moe, tp=2, ep=2, sequence_parallel=False)
    assert "sequence_parallel" in m
    assert check_parallel_sizes(dense, cp=2) == []  # CP is built
    (m,) = check_parallel_sizes(dense, tp=2, cp=2)  # megatron-core's GDN config rule: heads divisible by TP x CP
    assert "context_parallel_size=2" in m and "linear_num_key_heads (2)" in m
    (m,) = check_parallel_sizes(moe, etp=3)
    assert "expert_tensor_parallel_size=3 does not divide moe_intermediate_size (32)" in m
    (m,) = check_parallel_sizes(dense, tp=2, key_prefix="critic.megatron", pp=3)
    assert m.startswith("critic.megatron.pipeline_model_parallel_size")


def test_mcore_registry_lookup(configs):
    assert mreg.get_supported_model(configs["dense"]) is mreg.SupportedModel.QWEN3_5
    assert mreg.get_supported_model(configs["vl_moe"]) is mreg.SupportedModel.QWEN3_5_MOE_VL
    assert mreg.transformer_config_kwargs(configs["moe"])["num_moe_experts"] == 4
    conv = mreg.get_mcore_weight_converter(configs["moe"])
    assert callable(conv.mcore_to_hf) and callable(conv.mcore_state_for_rank)
    # a model without a registration gets a message naming what to do
    other = type("Cfg", (), {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})()
    with pytest.raises(ValueError, match="register_mcore_model"):
        mreg.get_supported_model(other)


def test_mcore_register_one_model(configs):
    key = "TinyTestForCausalLM"
    try:
        mreg.register_mcore_model(key, config_converter=lambda cfg, dtype, **o: {"num_layers": 1, **o},
                                  initializer="nowhere.build", forward="nowhere.forward", weight_converter=object())
        cfg = type("Cfg", (), {"architectures": [key], "model_type": "tiny"})()
        assert mreg.get_supported_model(cfg) == key
        assert mreg.transformer_config_kwargs(cfg, hidden_size=8) == {"num_layers": 1, "hidden_size": 8}
        with pytest.raises(ImportError, match=r"pip install -e \.\[mcore\]"):
            mreg.get_mcore_forward_fn(cfg)
    finally:
        for reg in (mreg.MODEL_CONFIG_CONVERTER_REGISTRY, mreg.MODEL_INITIALIZER_REGISTRY, mreg.MODEL_FORWARD_REGISTRY,
                    mreg.MODEL_WEIGHT_CONVERTER_REGISTRY):
            reg.pop(key, None)
            reg.extras.pop(key, None)


def test_mcore_model_needs_the_extra(configs):
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install -e \.\[mcore\]"):
            mreg.init_mcore_model(None, configs["dense"])
    else:
        pytest.skip("megatron-core is installed here")


def test_mcore_lookup_goes_through_the_model_spec(configs):
    """The Megatron model of a checkpoint is the one its ModelSpec names (mcore_model), not a string match on
    the architecture: an architecture registered with a Qwen3.5 spec builds the Qwen3.5 Megatron model."""
    import dataclasses

    from verl.models.registry import SUPPORTED_ARCHITECTURES

    spec = dataclasses.replace(SUPPORTED_ARCHITECTURES["Qwen3_5ForCausalLM"], architecture="MyQwenishForCausalLM")
    SUPPORTED_ARCHITECTURES.register(spec.architecture, spec)
    try:
        cfg = type("Cfg", (), {"architectures": ["MyQwenishForCausalLM"], "model_type": "myqwenish"})()
        assert mreg.get_supported_model(cfg) is mreg.SupportedModel.QWEN3_5
        SUPPORTED_ARCHITECTURES.register(spec.architecture, dataclasses.replace(spec, mcore_model=None),
                                         override=True)
        with pytest.raises(ValueError, match="register_mcore_model"):
            mreg.get_supported_model(cfg)  # the spec says: not on Megatron
    finally:
        SUPPORTED_ARCHITECTURES.pop(spec.architecture)
    # no architectures at all: the spec found by model_type names the model
    moe = type(configs["moe"])(**configs["moe"].to_dict())
    moe.architectures = None
    assert mreg.get_supported_model(moe) is mreg.SupportedModel.QWEN3_5_MOE


def test_mcore_model_build_reports_kernels(configs, monkeypatch, capsys, caplog):
    """Building the Megatron model says which kernels it runs, and on CUDA warns about a missing fla (the Gated
    DeltaNet layers would run the torch reference). megatron-core is not needed: the initializer is a stand-in."""
    import logging

    import verl.models.mcore as mcore_pkg
    from verl.models import kernels
    from verl.models.qwen3_5 import gated_deltanet

    monkeypatch.setattr(mcore_pkg, "require_megatron", lambda: None)
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "_reported", set())
    monkeypatch.setattr(gated_deltanet, "_fla_functions", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(gated_deltanet.GDN_BACKEND_ENV, raising=False)
    key = mreg.SupportedModel.QWEN3_5
    original = dict.get(mreg.MODEL_INITIALIZER_REGISTRY, key)
    built = []
    mreg.MODEL_INITIALIZER_REGISTRY.register(key, lambda tf, hf, **kw: built.append(hf) or "model", override=True)
    try:
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            assert mreg.init_mcore_model(None, configs["dense"]) == "model"
            mreg.init_mcore_model(None, configs["dense"], vp_stage=1)  # a second chunk: no second report
    finally:
        mreg.MODEL_INITIALIZER_REGISTRY.register(key, original, override=True)
    assert len(built) == 2
    out = capsys.readouterr().out
    assert out.count("[verl.kernels] Qwen3_5ForCausalLM (mcore) on cuda: gated_deltanet=torch") == 1
    assert [r.getMessage() for r in caplog.records if "pip install flash-linear-attention`" in r.getMessage()]
