"""FLOP counts of tiny configs, worked out by hand below, vs verl.utils.flops_counter."""

import math
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, Qwen3_5Config, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config

import verl.models  # noqa: F401  (registers the model specs, whose formulas the counter looks up)
from verl.utils.flops_counter import FlopsCounter, count_flops, forward_flops, get_device_flops

SEQLENS = [3, 5]  # 8 tokens; causal visible pairs: 3*4/2 + 5*6/2 = 6 + 15 = 21
TOKENS, PAIRS = 8, 21
C = 64  # GDN chunk


def _tiny_qwen3_5(cls=Qwen3_5TextConfig, **extra):
    return cls(
        vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=4,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=2, linear_value_head_dim=3,
        linear_conv_kernel_dim=4, **extra,
    )


def _gdn_fwd_flops():
    # Per token per value head MACs: 3*dk*dv + C*(3*dk + 2*dv) + C^2/3 with dk=2, dv=3.
    macs = 3 * 2 * 3 + C * (3 * 2 + 2 * 3) + C * C / 3  # 18 + 768 + 1365.33
    return 2 * macs * 2 * TOKENS  # 2 value heads, 1 linear layer


def test_qwen3_5_dense_by_hand():
    # Full-attention layer weights: q_proj 8 x (2*2*4 incl. gate) = 128, k 8x4 = 32, v 32, o 8x8 = 64.
    full_attn = 128 + 32 + 32 + 64  # 256
    # GDN layer: key_dim 1*2 = 2, value_dim 2*3 = 6.
    # in_proj_qkv 8 x (2+2+6) = 80, in_proj_z 8x6 = 48, in_proj_b 8x2 = 16, in_proj_a 16, out_proj 6x8 = 48.
    gdn = 80 + 48 + 16 + 16 + 48  # 208
    conv = (2 + 2 + 6) * 4  # depthwise conv over 10 channels, kernel 4: 40 MACs/token
    mlp = 2 * 3 * 8 * 12  # SwiGLU on both layers: 576
    lm_head = 8 * 10  # 80; the embedding lookup is free
    dense = 2 * (full_attn + gdn + conv + mlp + lm_head) * TOKENS  # 2 * 1160 * 8 = 18560
    attn = 2 * 2 * 2 * 4 * PAIRS  # QK^T + PV, 2 heads x dim 4, one full layer: 672
    fwd = dense + attn + _gdn_fwd_flops()
    cfg = _tiny_qwen3_5()
    assert forward_flops(cfg, SEQLENS) == pytest.approx(fwd, rel=1e-12)
    assert count_flops(cfg, SEQLENS) == pytest.approx(3 * fwd, rel=1e-12)
    assert dense == 18560 and attn == 672


def test_qwen3_5_vl_uses_text_config():
    text = _tiny_qwen3_5()
    vl = Qwen3_5Config(text_config=text.to_dict())
    assert vl.model_type == "qwen3_5"
    assert forward_flops(vl, SEQLENS) == pytest.approx(forward_flops(text, SEQLENS))


def test_qwen3_5_moe_by_hand():
    cfg = _tiny_qwen3_5(
        Qwen3_5MoeTextConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=5,
        shared_expert_intermediate_size=6,
    )
    # Per layer: router 8x4 = 32, two routed SwiGLU experts 2 * 3*8*5 = 240, shared SwiGLU 3*8*6 = 144,
    # shared-expert gate 8x1 = 8 -> 424 per layer, 848 for 2 layers (replacing the dense 576).
    moe = 2 * (32 + 240 + 144 + 8)
    dense = 2 * (256 + 208 + 40 + moe + 80) * TOKENS
    fwd = dense + 672 + _gdn_fwd_flops()
    assert forward_flops(cfg, SEQLENS) == pytest.approx(fwd, rel=1e-12)


def test_generic_qwen3_by_hand():
    cfg = Qwen3Config(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    # Per layer: q 8x8 = 64, k 8x4 = 32, v 32, o 64 -> 192; MLP 3*8*12 = 288. lm_head 80.
    dense = 2 * (3 * (192 + 288) + 80) * TOKENS  # 2 * 1520 * 8 = 24320
    attn = 3 * 2 * 2 * 2 * 4 * PAIRS  # three causal layers: 2016
    assert forward_flops(cfg, SEQLENS) == pytest.approx(dense + attn)
    assert dense + attn == 26336


def test_estimate_flops_units_and_causality():
    cfg = _tiny_qwen3_5()
    achieved, promised = FlopsCounter(cfg).estimate_flops(SEQLENS, delta_time=0.5)
    assert achieved == pytest.approx(count_flops(cfg, SEQLENS) / 0.5 / 1e12)
    assert promised == get_device_flops()
    # Attention is per sequence: one sequence of 8 costs more than 3 + 5 (quadratic term).
    assert forward_flops(cfg, [8]) - forward_flops(cfg, SEQLENS) == pytest.approx(2 * 2 * 2 * 4 * (36 - PAIRS))


def test_unknown_model_type_reads_zero():
    cfg = SimpleNamespace(model_type="not_a_model")
    with pytest.warns(UserWarning):
        counter = FlopsCounter(cfg)
    assert counter.estimate_flops([4], 1.0)[0] == 0.0


def test_device_flops():
    assert get_device_flops("T", "NVIDIA H100 80GB HBM3") == pytest.approx(989)
    assert get_device_flops("T", "NVIDIA H200") == pytest.approx(989)  # not H20's 148
    assert get_device_flops("T", "NVIDIA H100 PCIe") == pytest.approx(756)  # not the SXM part's 989
    assert get_device_flops("T", "NVIDIA H100 NVL") == pytest.approx(835)
    assert get_device_flops("T", "NVIDIA A100-SXM4-80GB") == pytest.approx(312)
    assert get_device_flops("G", "CPU") == pytest.approx(448)
    assert get_device_flops("B", "NVIDIA H20") == pytest.approx(148e12)
    assert math.isinf(get_device_flops("T", "Mystery GPU"))
    with pytest.raises(ValueError):
        get_device_flops("X", "CPU")


def test_formula_comes_from_the_model_spec():
    """FLOPs are looked up through ModelSpec.flops_fn (by architecture), not by model_type: a model registered
    with a formula gets it whatever its model_type says, and each Qwen3.5 spec names the Qwen3.5 formula."""
    import dataclasses

    from verl.models.qwen3_5.flops import qwen3_5_forward_flops
    from verl.models.registry import SUPPORTED_ARCHITECTURES, get_model_spec
    from verl.utils.flops_counter import dense_decoder_forward_flops

    for spec in SUPPORTED_ARCHITECTURES.values():
        want = qwen3_5_forward_flops if spec.family.startswith("qwen3_5") else dense_decoder_forward_flops
        assert spec.resolve("flops_fn") is want, spec.architecture
    qwen3 = Qwen3Config(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    qwen3.model_type = "my_decoder"  # unknown to any formula table keyed by model_type
    qwen3.architectures = ["MyDecoderForCausalLM"]
    assert forward_flops(qwen3, SEQLENS) == 0.0
    base = SUPPORTED_ARCHITECTURES["Qwen3_5ForCausalLM"]
    spec = dataclasses.replace(base, architecture="MyDecoderForCausalLM",
                               flops_fn="verl.utils.flops_counter.dense_decoder_forward_flops")
    SUPPORTED_ARCHITECTURES.register(spec.architecture, spec)
    try:
        assert get_model_spec(qwen3) is spec
        assert forward_flops(qwen3, SEQLENS) == pytest.approx(26336)  # test_generic_qwen3_by_hand's count
        assert forward_flops(qwen3, SEQLENS) == dense_decoder_forward_flops(qwen3, SEQLENS)
    finally:
        SUPPORTED_ARCHITECTURES.pop(spec.architecture)


def test_generic_spec_names_the_dense_formula_for_known_families_only():
    from verl.models.registry import get_model_spec

    llama = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    assert get_model_spec(llama).flops_fn == "verl.utils.flops_counter.dense_decoder_forward_flops"
    assert forward_flops(llama, SEQLENS) > 0
    assert get_model_spec(SimpleNamespace(model_type="gpt2", architectures=["GPT2LMHeadModel"])).flops_fn is None


def test_update_mfu_counts_every_rank_tokens_and_every_epoch(monkeypatch):
    """perf/mfu/* as upstream defines it: all ranks' tokens x ppo_epochs, over the time and the peak of all ranks."""
    import verl.utils.flops_counter as fc
    from verl.protocol import DataProto
    from verl.workers import engine_workers

    monkeypatch.setattr(fc, "get_device_flops", lambda unit="T", device_name=None: 2.0)  # TFLOP/s per rank
    monkeypatch.setattr(engine_workers.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(engine_workers.dist, "get_world_size", lambda: 4)
    cfg = _tiny_qwen3_5()
    data = DataProto(meta_info={"global_token_num": SEQLENS})
    mfu = engine_workers.update_mfu(FlopsCounter(cfg), data, seconds=0.25, passes=3)
    assert mfu == pytest.approx(count_flops(cfg, SEQLENS) * 3 / 0.25 / 1e12 / (2.0 * 4))
    assert engine_workers.update_mfu(None, data, 0.25, 1) == 0.0  # no model config: no formula
    assert engine_workers.update_mfu(FlopsCounter(cfg), DataProto(meta_info={}), 0.25, 1) == 0.0
    monkeypatch.setattr(fc, "get_device_flops", lambda unit="T", device_name=None: float("inf"))
    assert engine_workers.update_mfu(FlopsCounter(cfg), data, 0.25, 1) == 0.0  # unknown device: 0, not a guess
