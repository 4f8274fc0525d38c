"""Where NPU patches get applied: at model load (``load_hf_model``), only when the device is an NPU.

STAND-IN: the NPU is simulated by making ``verl.utils.device.get_device_name`` answer "npu" and recording
``apply_npu_patches`` instead of running it (torch_npu's kernels cannot run here). The real-NPU version of
these checks is tests/npu/test_npu_runtime.py (``-m npu``).
"""

import pytest
import torch

from verl.models.qwen3_5 import npu_patch
from verl.models.transformers.npu_patch import apply_npu_patches_for_model


@pytest.fixture
def tiny_dense(tmp_path):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    build_tiny_qwen3_5(tmp_path, kind="dense", dtype=torch.float32)
    return tmp_path


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(npu_patch, "apply_npu_patches", lambda families: calls.append(tuple(families)) or ["x"])
    return calls


def test_patches_applied_at_model_load_on_npu(tiny_dense, recorded, monkeypatch):
    from verl.models.registry import load_hf_model
    from verl.utils import device

    monkeypatch.setattr(device, "get_device_name", lambda: "npu")
    load_hf_model(str(tiny_dense), dtype=torch.float32)
    assert recorded == [("qwen3_5",)]


@pytest.mark.parametrize("device_name", ["cpu", "cuda"])
def test_never_applied_off_npu(tiny_dense, recorded, monkeypatch, device_name):
    from verl.models.registry import load_hf_model
    from verl.utils import device

    monkeypatch.setattr(device, "get_device_name", lambda: device_name)
    load_hf_model(str(tiny_dense), dtype=torch.float32)
    assert recorded == []


def test_other_architectures_keep_their_forward_on_npu(recorded, monkeypatch):
    from transformers import LlamaConfig

    from verl.utils import device

    monkeypatch.setattr(device, "get_device_name", lambda: "npu")
    assert apply_npu_patches_for_model(LlamaConfig(architectures=["LlamaForCausalLM"])) == []
    assert recorded == []


def test_decided_by_the_model_spec(recorded, monkeypatch):
    """'Is this a Qwen3.5-family model' is the spec's answer (its ``patches``), not a model_type string: a spec
    that opts out of the Qwen3.5 patches gets no NPU forwards either, and the spec's family picks the file."""
    import dataclasses

    from transformers import Qwen3_5MoeTextConfig

    from verl.models.registry import SUPPORTED_ARCHITECTURES
    from verl.utils import device

    monkeypatch.setattr(device, "get_device_name", lambda: "npu")
    base = SUPPORTED_ARCHITECTURES["Qwen3_5MoeForCausalLM"]
    for name, patch in (("MyMoeForCausalLM", base.npu_patch), ("MyStockMoeForCausalLM", None)):
        SUPPORTED_ARCHITECTURES.register(name, dataclasses.replace(base, architecture=name, npu_patch=patch))
    try:
        cfg = Qwen3_5MoeTextConfig(architectures=["MyMoeForCausalLM"])
        assert apply_npu_patches_for_model(cfg) == ["x"]
        cfg.architectures = ["MyStockMoeForCausalLM"]
        assert apply_npu_patches_for_model(cfg) == []
    finally:
        for name in ("MyMoeForCausalLM", "MyStockMoeForCausalLM"):
            SUPPORTED_ARCHITECTURES.pop(name)
    assert recorded == [("qwen3_5_moe",)]
