"""HF <-> engine name rules for Qwen3.5 dense / MoE / VL, and the routed-expert layouts (no vLLM needed)."""

import pytest
import torch
from _ws_helpers import tiny

from verl.models.qwen3_5.weight_sync import Qwen35Layout
from verl.workers.weight_sync import (
    engine_targets,
    expand_fused_experts,
    expected_engine_names,
    strip_wrapper_names,
    to_engine_loader_format,
)


@pytest.mark.parametrize(
    "trainer_name",
    [
        "model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight",
        "_orig_mod.model.layers.0.mlp.up_proj.weight",
        "base_model.model.model.layers.0.mlp.up_proj.weight",
    ],
)
def test_strip_wrapper_names(trainer_name):
    assert strip_wrapper_names(trainer_name) == "model.layers.0.mlp.up_proj.weight"


def test_dense_engine_names_fuse_projections():
    m = tiny("dense")
    layout = Qwen35Layout.from_hf_config(m.config)
    assert not layout.moe and not layout.vl and layout.tie_word_embeddings
    names = expected_engine_names((n for n, _ in m.named_parameters()), layout)
    for fused in (
        "model.layers.3.self_attn.qkv_proj.weight",
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "model.layers.0.linear_attn.in_proj_ba.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
    ):
        assert fused in names
    assert not any(n.endswith((".q_proj.weight", ".in_proj_z.weight", ".up_proj.weight")) for n in names)
    assert engine_targets("model.layers.3.self_attn.k_proj.weight", layout) == [
        ("model.layers.3.self_attn.qkv_proj.weight", "k")
    ]
    # Tied embeddings: the engine owns no lm_head parameter, so lm_head is skipped, not written.
    assert engine_targets("lm_head.weight", layout) == []


def test_moe_engine_names_fuse_experts():
    m = tiny("moe")
    layout = Qwen35Layout.from_hf_config(m.config)
    assert layout.moe and layout.num_experts == 4
    fused = engine_targets("model.layers.1.mlp.experts.gate_up_proj", layout)
    assert {t for t, _ in fused} == {"model.layers.1.mlp.experts.w13_weight"}
    assert sorted(s for _, s in fused) == sorted((e, w) for e in range(4) for w in ("w1", "w3"))
    assert engine_targets("model.layers.1.mlp.experts.2.down_proj.weight", layout) == [
        ("model.layers.1.mlp.experts.w2_weight", (2, "w2"))
    ]
    assert engine_targets("model.layers.1.mlp.shared_expert.up_proj.weight", layout) == [
        ("model.layers.1.mlp.shared_expert.gate_up_proj.weight", 1)
    ]
    assert engine_targets("model.layers.1.mlp.gate.weight", layout) == [("model.layers.1.mlp.gate.weight", None)]


@pytest.mark.parametrize("lm_only", [True, False])
def test_vl_prefixes(lm_only):
    m = tiny("vl")
    layout = Qwen35Layout.from_hf_config(m.config, language_model_only=lm_only)
    assert layout.vl and not layout.tie_word_embeddings
    assert engine_targets("model.language_model.layers.3.self_attn.q_proj.weight", layout) == [
        ("language_model.model.layers.3.self_attn.qkv_proj.weight", "q")
    ]
    assert engine_targets("lm_head.weight", layout) == [("language_model.lm_head.weight", None)]
    vis = engine_targets("model.visual.merger.linear_fc1.weight", layout)
    assert vis == ([] if lm_only else [("visual.merger.linear_fc1.weight", None)])


def test_expand_fused_experts_matches_hf_expert_math():
    m = tiny("moe")
    experts = m.model.layers[0].mlp.experts
    name = "model.layers.0.mlp.experts"
    per = dict(expand_fused_experts(f"{name}.gate_up_proj", experts.gate_up_proj.detach()))
    per.update(expand_fused_experts(f"{name}.down_proj", experts.down_proj.detach()))
    assert len(per) == 3 * 4
    x = torch.randn(5, m.config.hidden_size)
    for e in range(4):
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        want = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
        g = x @ per[f"{name}.{e}.gate_proj.weight"].T
        u = x @ per[f"{name}.{e}.up_proj.weight"].T
        got = (experts.act_fn(g) * u) @ per[f"{name}.{e}.down_proj.weight"].T
        torch.testing.assert_close(got, want)
    # Non-expert names pass through untouched.
    t = torch.zeros(2)
    assert list(expand_fused_experts("model.norm.weight", t)) == [("model.norm.weight", t)]
    with pytest.raises(ValueError, match="expected"):
        list(expand_fused_experts(f"{name}.gate_up_proj", torch.zeros(4, 3, 2)))


def test_loader_format_drops_unowned_and_expands():
    m = tiny("vl_moe")
    pairs = [(n, p.detach()) for n, p in m.named_parameters()]
    fused = dict(to_engine_loader_format(pairs, Qwen35Layout.from_hf_config(m.config)))
    assert not any(n.startswith("model.visual.") for n in fused)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in fused
    per = dict(to_engine_loader_format(pairs, Qwen35Layout.from_hf_config(m.config, expert_format="per_expert")))
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in per
    assert not any(n.endswith("experts.gate_up_proj") for n in per)


def test_layout_rejects_unknown_expert_format():
    with pytest.raises(ValueError, match="expert_format"):
        Qwen35Layout.from_hf_config(tiny("dense").config, expert_format="stacked")


def test_layout_reads_expert_path_from_engine_names():
    # Newer vLLM nests the fused expert tensors one module deeper; the mapping must follow the engine.
    layout = Qwen35Layout.from_hf_config(tiny("moe").config)
    newer = layout.matching_engine(["model.layers.0.mlp.experts.routed_experts.w13_weight", "model.norm.weight"])
    assert newer.engine_experts_path == "experts.routed_experts"
    assert engine_targets("model.layers.0.mlp.experts.down_proj", newer)[0][0] == (
        "model.layers.0.mlp.experts.routed_experts.w2_weight"
    )
    assert layout.matching_engine(["model.layers.0.mlp.experts.w13_weight"]).engine_experts_path == "experts"
