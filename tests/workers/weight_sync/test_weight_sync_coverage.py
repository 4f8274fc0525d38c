"""check_coverage: every engine parameter written exactly once, failures name the tensors."""

import pytest
from _ws_helpers import tiny

from verl.models.qwen3_5.weight_sync import Qwen35Layout
from verl.workers.weight_sync import WeightCoverageError, check_coverage, expected_engine_names
from verl.workers.weight_sync.names import expand_fused_experts


def _setup(kind, **layout_kw):
    m = tiny(kind)
    layout = Qwen35Layout.from_hf_config(m.config, **layout_kw)
    hf = [n for n, _ in m.named_parameters()]
    return hf, layout, expected_engine_names(hf, layout)


@pytest.mark.parametrize("kind", ["dense", "moe", "vl", "vl_moe"])
def test_full_sync_passes(kind):
    hf, layout, engine = _setup(kind)
    check_coverage(engine, hf, layout)


def test_missing_plain_parameter_is_named():
    hf, layout, engine = _setup("dense")
    hf.remove("model.layers.2.post_attention_layernorm.weight")
    with pytest.raises(WeightCoverageError, match=r"never written: model\.layers\.2\.post_attention_layernorm"):
        check_coverage(engine, hf, layout)


def test_partly_written_fused_parameter_names_the_shard():
    hf, layout, engine = _setup("dense")
    hf.remove("model.layers.3.self_attn.k_proj.weight")
    with pytest.raises(WeightCoverageError, match=r"qkv_proj\.weight \(missing shards \['k'\]\)") as e:
        check_coverage(engine, hf, layout)
    assert e.value.incomplete == {"model.layers.3.self_attn.qkv_proj.weight": {"k"}}


def test_missing_expert_shard_in_per_expert_format():
    m = tiny("moe")
    layout = Qwen35Layout.from_hf_config(m.config, expert_format="per_expert")
    names = [n for name, p in m.named_parameters() for n, _ in expand_fused_experts(name, p.detach())]
    engine = expected_engine_names(names, layout)
    check_coverage(engine, names, layout)
    names.remove("model.layers.1.mlp.experts.2.up_proj.weight")
    with pytest.raises(WeightCoverageError, match=r"layers\.1\.mlp\.experts\.w13_weight.*\(2, 'w3'\)"):
        check_coverage(engine, names, layout)


def test_duplicate_and_unknown_writes_fail():
    hf, layout, engine = _setup("moe")
    with pytest.raises(WeightCoverageError, match=r"more than once: model\.norm\.weight"):
        check_coverage(engine, hf + ["model.norm.weight"], layout)
    with pytest.raises(WeightCoverageError, match=r"match no engine parameter: model\.layers\.0\.bogus"):
        check_coverage(engine, hf + ["model.layers.0.bogus.weight"], layout)


def test_engine_names_mode_without_layout():
    check_coverage({"a", "b"}, ["b", "a"])
    with pytest.raises(WeightCoverageError, match="never written: b"):
        check_coverage({"a", "b"}, ["a"])


def test_vision_tower_required_when_engine_has_it():
    hf, layout, engine = _setup("vl", language_model_only=False)
    assert any(n.startswith("visual.") for n in engine)
    text_only = [n for n in hf if not n.startswith("model.visual.")]
    with pytest.raises(WeightCoverageError, match=r"never written: visual\."):
        check_coverage(engine, text_only, layout)
