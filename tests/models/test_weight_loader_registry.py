"""verl.models.weight_loader_registry: upstream's Megatron checkpoint loader/saver registry (CPU, no megatron).

The chunk stand-in is a plain module whose parameter names are megatron-core's (what the converter says the
chunk holds), so the generic GPT loader and saver run exactly as on a real chunk with parallel_state unset.
"""

import pytest
import safetensors.torch
import torch
from torch import nn

from verl.models.mcore.gpt_checkpoint import load_state_dict_to_megatron_gptmodel, merge_megatron_ckpt_gptmodel
from verl.models.qwen3_5.mcore.weight_converter import hf_to_mcore_shards
from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
from verl.models.weight_loader_registry import get_weight_loader, get_weight_saver


def _chunk_like(state: dict) -> nn.Module:
    """A module with one zero parameter per mcore name (nested modules along the dots)."""
    root = nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.zeros_like(tensor)))
    return root


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    model = build_tiny_qwen3_5(path, kind="dense", seed=3, with_tokenizer=False, tie_word_embeddings=False)
    return model.config, safetensors.torch.load_file(str(path / "model.safetensors"))


def test_upstream_interface_and_qwen3_5_registration():
    for arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
        assert get_weight_loader(arch) is load_state_dict_to_megatron_gptmodel
        assert get_weight_saver(arch) is merge_megatron_ckpt_gptmodel
    with pytest.raises(ValueError, match="NoSuchForCausalLM loader are not supported"):
        get_weight_loader("NoSuchForCausalLM")
    with pytest.raises(ValueError, match="saver are not supported"):
        get_weight_saver("NoSuchForCausalLM")


def test_generic_gpt_loader_then_saver_round_trips(dense):
    config, hf_state = dense
    expected = hf_to_mcore_shards(hf_state, config)[(0, 0, 0, 0)]
    chunk = _chunk_like(expected)
    get_weight_loader("Qwen3_5ForCausalLM")(hf_state, [chunk], config, torch.float32)
    loaded = dict(chunk.named_parameters())
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    saved = get_weight_saver("Qwen3_5ForCausalLM")([chunk], config, torch.float32)
    text = {k: v for k, v in hf_state.items() if not k.startswith("mtp.")}
    assert set(saved) == set(text)
    for name, tensor in text.items():
        assert torch.equal(saved[name], tensor.float()), name


def test_value_model_keeps_its_head(dense):
    config, hf_state = dense
    expected = hf_to_mcore_shards(hf_state, config)[(0, 0, 0, 0)]
    chunk = _chunk_like(expected)
    head = chunk.output_layer.weight
    with torch.no_grad():
        head.fill_(0.5)
    load_state_dict_to_megatron_gptmodel(hf_state, chunk, config, is_value_model=True)
    assert torch.all(head == 0.5)  # the critic's value head is not the LM head
    saved = merge_megatron_ckpt_gptmodel(chunk, config, is_value_model=True)
    assert "lm_head.weight" not in saved and torch.all(saved["score.weight"] == 0.5)
