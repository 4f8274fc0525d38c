"""LoRA adapter helpers: saved-format directory, engine module mapping, unsupported configs refused."""

import json

import pytest
import torch
from _ws_helpers import tiny

from verl.models.qwen3_5.weight_sync import Qwen35Layout
from verl.workers.weight_sync import (
    check_engine_lora_targets,
    check_lora_config,
    engine_lora_module,
    iter_hf_weights,
    write_lora_adapter,
)


def _peft_model():
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "in_proj_z", "down_proj"])
    return get_peft_model(tiny("dense", fresh=True), cfg), cfg


def test_written_adapter_loads_back_into_peft(tmp_path):
    from peft import PeftModel

    peft_model, cfg = _peft_model()
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    path = write_lora_adapter(tmp_path / "a", iter_hf_weights(peft_model, lora_mode="adapter"), cfg)
    saved = json.loads((path / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["peft_type"] == "LORA" and isinstance(saved["target_modules"], list)
    reloaded = PeftModel.from_pretrained(tiny("dense", fresh=True), str(path))
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, peft_model(x).logits)


def test_engine_module_mapping():
    layout = Qwen35Layout.from_hf_config(tiny("dense").config)
    assert engine_lora_module("model.layers.3.self_attn.k_proj", layout) == ("model.layers.3.self_attn.qkv_proj", "k")
    assert engine_lora_module("model.layers.0.linear_attn.in_proj_z", layout) == (
        "model.layers.0.linear_attn.in_proj_qkvz", "z"
    )
    assert engine_lora_module("model.layers.0.mlp.down_proj", layout) == ("model.layers.0.mlp.down_proj", None)
    names = ["base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"]
    assert check_engine_lora_targets(names, layout, ["model.layers.3.self_attn.qkv_proj"]) == {
        "model.layers.3.self_attn.q_proj": ("model.layers.3.self_attn.qkv_proj", "q")
    }
    with pytest.raises(ValueError, match="no engine module"):
        check_engine_lora_targets(names, layout, ["model.layers.3.self_attn.o_proj"])
    moe = Qwen35Layout.from_hf_config(tiny("moe").config)
    with pytest.raises(ValueError, match="routed experts"):
        engine_lora_module("model.layers.0.mlp.experts.gate_up_proj", moe)


def test_unsupported_lora_configs_refused(tmp_path):
    with pytest.raises(NotImplementedError, match="target_parameters"):
        check_lora_config({"target_parameters": ["mlp.experts.gate_up_proj"]})
    with pytest.raises(NotImplementedError, match="DoRA"):
        check_lora_config({"use_dora": True})
    with pytest.raises(ValueError, match="saved-format"):
        write_lora_adapter(tmp_path, [("model.q_proj.weight", torch.ones(1))], {"r": 1})
    with pytest.raises(ValueError, match="no LoRA tensors"):
        write_lora_adapter(tmp_path, [], {"r": 1})
