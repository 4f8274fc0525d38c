"""HF <-> megatron-core weight mapping for Qwen3.5 (pure torch; no megatron needed)."""

import itertools

import pytest
import safetensors.torch
import torch

from verl.models.qwen3_5.mcore.weight_converter import (
    ParallelLayout,
    global_mcore_name,
    hf_to_mcore_shards,
    mcore_shards_to_hf,
    mcore_state_for_rank,
    mcore_to_hf,
    to_hf_stream,
)
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

KINDS = {
    "dense_tied": ("dense", {}),
    "dense_untied": ("dense", {"tie_word_embeddings": False}),
    "moe_tied": ("moe", {}),
    "moe_untied": ("moe", {"tie_word_embeddings": False}),
    "vl_moe": ("vl_moe", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (hf config, state dict as written by save_pretrained: checkpoint layout)."""
    cache = {}

    def get(name):
        if name not in cache:
            kind, overrides = KINDS[name]
            path = tmp_path_factory.mktemp(name)
            model = build_tiny_qwen3_5(path, kind=kind, seed=1, with_tokenizer=False, **overrides)
            cache[name] = (model.config, safetensors.torch.load_file(str(path / "model.safetensors")))
        return cache[name]

    return get


def _text_only(state):
    return {k: v for k, v in state.items() if ".visual." not in k and not k.startswith("model.visual")}


LAYOUTS = [ParallelLayout(tp, pp, ep) for tp, pp, ep in itertools.product((1, 2), (1, 2), (1, 2))]


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l.tp}pp{l.pp}ep{l.ep}")
def test_mcore_round_trip_exact(checkpoints, name, layout):
    config, state = checkpoints(name)
    if layout.ep > 1 and "moe" not in name:
        pytest.skip("expert parallelism needs a MoE model")
    shards = hf_to_mcore_shards(state, config, layout)
    assert len(shards) == layout.tp * layout.pp * layout.ep
    back = mcore_shards_to_hf(shards, config, layout)
    expected = _text_only(state)
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert back[k].shape == v.shape, k
        assert torch.equal(back[k], v), k


def test_mcore_shards_are_split_the_megatron_way(checkpoints):
    config, state = checkpoints("moe_untied")
    text = config
    layout = ParallelLayout(tp=2, pp=2, ep=2)
    shards = hf_to_mcore_shards(state, config, layout)
    s = shards[(1, 0, 1, 1)]  # pp rank 1 holds layers 2, 3 (local 0, 1); tp rank 1; ep rank 1
    kd = text.linear_num_key_heads * text.linear_key_head_dim
    vd = text.linear_num_value_heads * text.linear_value_head_dim
    hf_qkv = state["model.layers.2.linear_attn.in_proj_qkv.weight"]
    in_proj = s["decoder.layers.0.self_attention.in_proj.weight"]
    # rank 1 block starts with the second half of q, then the second half of k, then of v, z, b, a
    assert torch.equal(in_proj[: kd // 2], hf_qkv[kd // 2 : kd])
    assert torch.equal(in_proj[kd // 2 : kd], hf_qkv[kd + kd // 2 : 2 * kd])
    assert torch.equal(in_proj[kd : kd + vd // 2], hf_qkv[2 * kd + vd // 2 :])
    assert in_proj.shape[0] == (2 * kd + 2 * vd + 2 * text.linear_num_value_heads) // 2
    conv = s["decoder.layers.0.self_attention.conv1d.weight"]
    assert conv.shape == (kd + vd // 2, 1, text.linear_conv_kernel_dim)
    assert torch.equal(s["decoder.layers.0.self_attention.A_log"],
                       state["model.layers.2.linear_attn.A_log"][text.linear_num_value_heads // 2 :])
    # layer 3 is full attention: per-head [q; gate] rows of rank 1's heads, then its KV heads
    qkv = s["decoder.layers.1.self_attention.linear_qkv.weight"]
    q = state["model.layers.3.self_attn.q_proj.weight"]
    assert torch.equal(qkv[: q.shape[0] // 2], q[q.shape[0] // 2 :])
    # ep rank 1 holds experts 2 and 3 as local experts 0 and 1; fc1 is [gate_r; up_r] of etp rank 1
    fc1 = s["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    gate = state["model.layers.3.mlp.experts.2.gate_proj.weight"]
    up = state["model.layers.3.mlp.experts.2.up_proj.weight"]
    half = gate.shape[0] // 2
    assert torch.equal(fc1, torch.cat([gate[half:], up[half:]]))
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in s
    # last stage of an untied model carries the output layer; the first stage the embedding
    assert "output_layer.weight" in s and "embedding.word_embeddings.weight" not in s
    assert "embedding.word_embeddings.weight" in shards[(0, 0, 0, 0)]


def test_mcore_tied_embeddings_across_stages(checkpoints):
    config, state = checkpoints("dense_tied")
    one = mcore_state_for_rank(state, config)
    assert "output_layer.weight" not in one  # one stage: the output layer reuses the embedding
    two = hf_to_mcore_shards(state, config, ParallelLayout(pp=2))
    # two stages: the last one holds a copy megatron-core keeps in sync with the embedding
    assert torch.equal(two[(1, 0, 0, 0)]["output_layer.weight"], state["model.embed_tokens.weight"])
    assert mcore_to_hf("output_layer.weight", two[(1, 0, 0, 0)]["output_layer.weight"], config) == []


def test_mcore_virtual_pipeline_round_trip(checkpoints):
    config, state = checkpoints("moe_tied")
    layout = ParallelLayout(tp=2, pp=2, ep=2, vpp=2)
    shards = hf_to_mcore_shards(state, config, layout)
    assert global_mcore_name("module.decoder.layers.0.mlp.router.weight", config, layout, pp_rank=1, vp_stage=1) \
        == "decoder.layers.3.mlp.router.weight"
    back = mcore_shards_to_hf(shards, config, layout)
    assert all(torch.equal(back[k], v) for k, v in state.items()) and set(back) == set(state)


def test_mcore_stream_fuses_experts_like_the_hf_module(checkpoints):
    config, state = checkpoints("moe_untied")
    model = build_tiny_qwen3_5(None, kind="moe", seed=1, with_tokenizer=False, tie_word_embeddings=False)
    module_state = model.state_dict()
    shards = hf_to_mcore_shards(state, config, ParallelLayout())
    stream = to_hf_stream(shards[(0, 0, 0, 0)].items(), config, expert_format="fused")
    fused = dict(stream)
    assert set(fused) == set(module_state)
    for k, v in module_state.items():
        assert torch.equal(fused[k], v), k
    # the module layout loads back into mcore shards too
    again = hf_to_mcore_shards(module_state, config, ParallelLayout(ep=2))
    assert torch.equal(again[(0, 0, 0, 1)]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
                       state["model.layers.0.mlp.experts.3.down_proj.weight"])


def test_mcore_bad_names_and_missing_tensors(checkpoints):
    config, state = checkpoints("dense_tied")
    with pytest.raises(KeyError, match="not a Qwen3.5 megatron-core parameter"):
        mcore_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", torch.zeros(1), config)  # layer 0 is GDN
    with pytest.raises(KeyError, match="layer 9 out of range"):
        mcore_to_hf("decoder.layers.9.input_layernorm.weight", torch.zeros(1), config)
    broken = {k: v for k, v in state.items() if "in_proj_z" not in k}
    with pytest.raises(KeyError, match="in_proj_z.weight is missing"):
        hf_to_mcore_shards(broken, config)


def test_mcore_value_model_leaves_the_lm_head_out(checkpoints):
    config, state = checkpoints("moe_untied")
    lm = mcore_state_for_rank(state, config)
    critic = mcore_state_for_rank(state, config, value=True)
    assert "output_layer.weight" in lm and set(lm) - set(critic) == {"output_layer.weight"}


def test_safetensors_getter_reads_each_file_through_one_handle(tmp_path, monkeypatch):
    """Tensors come back exactly from a checkpoint of several files, and each file is opened once however many
    tensors are read (opening parses the file's whole header: per read, thousands of expert tensors made an
    engine's weight load take tens of seconds)."""
    import safetensors

    from verl.models.mcore import weight_loading

    parts = [{f"a.{i}.weight": torch.randn(3, 4) for i in range(5)},
             {f"b.{i}.weight": torch.randn(2) for i in range(7)}]
    for k, part in enumerate(parts):
        safetensors.torch.save_file(part, str(tmp_path / f"model-{k}.safetensors"))
    opened = []
    real = safetensors.safe_open

    def counting(path, *args, **kwargs):
        opened.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    get = weight_loading.safetensors_getter(str(tmp_path))
    before = len(opened)  # the index pass opens each file once
    for part in parts:
        for name, tensor in part.items():
            assert torch.equal(get(name), tensor)
            assert torch.equal(get(name), tensor)
    assert len(opened) - before == len(parts)
