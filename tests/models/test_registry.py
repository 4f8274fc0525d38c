"""Model registry: specs, model_type validation, class selection and loading."""

import pytest
import torch
import transformers as tf

from verl.models.registry import (
    SUPPORTED_ARCHITECTURES,
    check_model_type,
    get_model_class,
    get_model_spec,
    get_text_config,
    load_hf_model,
)
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5


@pytest.fixture(scope="module")
def configs(tiny_models):
    return {kind: tiny_models(kind).config for kind in ("dense", "moe", "vl", "vl_moe")}


def test_specs(configs):
    dense, moe, vl, vl_moe = (get_model_spec(configs[k]) for k in ("dense", "moe", "vl", "vl_moe"))
    assert (dense.is_vl, dense.is_moe, dense.has_linear_attention, dense.supports_packing) == (False, False, True, True)
    assert moe.is_moe and not moe.is_vl
    assert vl.is_vl and not vl.is_moe and vl.text_config_attr == "text_config"
    assert vl_moe.is_vl and vl_moe.is_moe
    assert set(SUPPORTED_ARCHITECTURES) == {
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3ForCausalLM",  # the second architecture's package (verl/models/qwen3)
    }
    assert get_text_config(configs["vl"]).model_type == "qwen3_5_text"


def test_spec_from_model_type_without_architectures(configs):
    cfg = tf.Qwen3_5MoeTextConfig()
    cfg.architectures = None
    assert get_model_spec(cfg).architecture == "Qwen3_5MoeForCausalLM"


@pytest.mark.parametrize("declared", [None, "", "qwen3_5_text", "qwen3_5"])
@pytest.mark.parametrize("kind", ["dense", "vl"])
def test_check_model_type_accepts(configs, kind, declared):
    assert check_model_type(configs[kind], declared).family == "qwen3_5"


@pytest.mark.parametrize("declared", ["qwen3_5_moe_text", "qwen3_5_moe"])
def test_check_model_type_accepts_moe(configs, declared):
    check_model_type(configs["moe"], declared)
    check_model_type(configs["vl_moe"], declared)


@pytest.mark.parametrize(
    "kind,declared", [("dense", "qwen3_5_moe_text"), ("moe", "qwen3_5_text"), ("vl", "qwen2"), ("dense", "llama")]
)
def test_check_model_type_rejects(configs, kind, declared):
    with pytest.raises(ValueError, match="model_type="):
        check_model_type(configs[kind], declared)


def test_check_model_type_generic():
    cfg = tf.LlamaConfig()
    check_model_type(cfg, "llama")
    with pytest.raises(ValueError):
        check_model_type(cfg, "qwen3_5_text")


def test_get_model_class(configs):
    assert get_model_class(configs["dense"]) is tf.Qwen3_5ForCausalLM
    assert get_model_class(configs["vl"]) is tf.Qwen3_5ForConditionalGeneration
    assert get_model_class(configs["vl"], for_vl=False) is tf.Qwen3_5ForCausalLM
    assert get_model_class(configs["vl_moe"], for_vl=False) is tf.Qwen3_5MoeForCausalLM
    with pytest.raises(ValueError):
        get_model_class(configs["dense"], for_vl=True)
    assert get_model_class(tf.LlamaConfig(architectures=["LlamaForCausalLM"])) is tf.AutoModelForCausalLM
    with pytest.raises(ValueError, match="not a causal language model"):
        get_model_class(tf.BertConfig(architectures=["BertModel"]))


def test_load_hf_model(tmp_path):
    vl = build_tiny_qwen3_5(tmp_path / "vl", kind="vl", with_tokenizer=False)
    full = load_hf_model(str(tmp_path / "vl"), dtype=torch.float32, declared_model_type="qwen3_5_text")
    assert isinstance(full, tf.Qwen3_5ForConditionalGeneration)
    text = load_hf_model(str(tmp_path / "vl"), dtype=torch.float32, for_vl=False)
    assert isinstance(text, tf.Qwen3_5ForCausalLM)
    ids = torch.randint(30, 120, (1, 9))
    torch.testing.assert_close(text(input_ids=ids).logits, vl(input_ids=ids).logits, atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        load_hf_model(str(tmp_path / "vl"), dtype=torch.float32, declared_model_type="qwen3_5_moe_text")
    bert = tf.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    tf.BertModel(bert).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="not a causal language model"):
        load_hf_model(str(tmp_path / "bert"))


# ------------------------------------------------------------------ the spec carries the model knowledge
def test_spec_carries_patches_lora_weight_sync_flops_and_mcore_names():
    from verl.models.registry import QWEN35_ALL_LINEAR, SUPPORTED_ARCHITECTURES, get_model_spec
    from verl.utils.registry import Registry

    assert isinstance(SUPPORTED_ARCHITECTURES, Registry)
    dense = SUPPORTED_ARCHITECTURES["Qwen3_5ForCausalLM"]
    moe = SUPPORTED_ARCHITECTURES.get_or_raise("Qwen3_5MoeForConditionalGeneration")
    from verl.models.qwen3_5.hf_patch import patch_qwen3_5_modules
    from verl.models.qwen3_5.hf_runner import Qwen35Runner
    from verl.models.qwen3_5.npu_patch import apply_npu_patches_for_spec

    assert dense.resolve("patches") is patch_qwen3_5_modules
    assert dense.native_packing and dense.lora_all_linear == QWEN35_ALL_LINEAR
    assert dense.resolve("hf_runner") is Qwen35Runner and dense.resolve("npu_patch") is apply_npu_patches_for_spec
    assert dense.lora_fused_expert_params == () and moe.lora_fused_expert_params
    assert dense.resolve("weight_sync_layout").__name__ == "Qwen35Layout"
    assert callable(dense.resolve("flops_fn")) and moe.mcore_model == "Qwen3_5MoeForConditionalGeneration"

    from transformers import LlamaConfig

    generic = get_model_spec(LlamaConfig(architectures=["LlamaForCausalLM"]))
    assert generic.patches is None and generic.lora_all_linear is None and generic.mcore_model is None
    assert generic.hf_runner is None and generic.npu_patch is None
    assert not generic.packs_with(LlamaConfig())  # HF packing by position ids needs flash-attn varlen
    fa2 = LlamaConfig()
    fa2._attn_implementation = "flash_attention_2"
    assert generic.packs_with(fa2) and dense.packs_with(LlamaConfig())


@pytest.mark.parametrize("kind,tied", [("dense", False), ("dense", True), ("moe", False), ("vl", False)])
def test_a_model_built_without_weights_takes_every_weight_it_is_given(tmp_path, kind, tied):
    """The Megatron engine's hf rollout copy is built from the config alone and filled by the weight sync: the same
    class, parameter names, shapes, dtypes, buffers, attention and experts implementation, generation config and
    weight tying as a loaded model, and once every parameter is written, the same logits -- all without the
    checkpoint's weight files."""
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.models.registry import build_hf_model_without_weights, load_hf_model

    build_tiny_qwen3_5(tmp_path, kind=kind, with_tokenizer=False, tie_word_embeddings=tied)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 3], "temperature": 0.6}')
    loaded = load_hf_model(str(tmp_path), dtype=torch.float32, for_vl=False).eval()
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # nothing to read: a build that tried would fail
    built = build_hf_model_without_weights(str(tmp_path), "cpu", dtype=torch.float32, for_vl=False).eval()

    assert type(built) is type(loaded)
    want = {n: (p.shape, p.dtype) for n, p in loaded.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in built.named_parameters()} == want
    assert [n for n, _ in built.named_buffers()] == [n for n, _ in loaded.named_buffers()]
    for (name, b), (_, a) in zip(built.named_buffers(), loaded.named_buffers()):
        torch.testing.assert_close(b, a, msg=name)
    assert built.config._attn_implementation == loaded.config._attn_implementation
    assert getattr(built.config, "_experts_implementation", None) == getattr(loaded.config, "_experts_implementation",
                                                                            None)
    assert built.generation_config.eos_token_id == [7, 3] == loaded.generation_config.eos_token_id
    def ties(m):
        return m.lm_head.weight.data_ptr() == m.get_input_embeddings().weight.data_ptr()

    assert ties(built) == ties(loaded) == tied
    ids = torch.tensor([[5, 9, 11, 3, 2]])
    with torch.no_grad():
        assert not torch.allclose(built(ids).logits, loaded(ids).logits)  # random until written
        for (name, p), (_, q) in zip(built.named_parameters(), loaded.named_parameters()):
            p.copy_(q)  # the engine's sync writes every parameter; a copy by name stands in for it here
        torch.testing.assert_close(built(ids).logits, loaded(ids).logits, rtol=0, atol=0)


def test_a_model_built_without_weights_lands_on_the_device_asked_for(tmp_path):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.models.registry import build_hf_model_without_weights

    build_tiny_qwen3_5(tmp_path, kind="dense", with_tokenizer=False)
    built = build_hf_model_without_weights(str(tmp_path), "meta", dtype=torch.bfloat16)
    assert {p.device.type for p in built.parameters()} == {"meta"}
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
