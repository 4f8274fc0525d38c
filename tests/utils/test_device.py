import importlib.util
from types import SimpleNamespace

import pytest
import torch

from verl.utils import device


def test_cpu_host_defaults(monkeypatch):
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", False)
    assert device.get_device_name() == "cpu"
    assert device.get_nccl_backend() == "gloo"
    assert device.get_visible_devices_keyword() == "CUDA_VISIBLE_DEVICES"
    assert device.get_device_id() == 0
    assert device.get_resource_name() == "CPU"
    assert device.is_device_available() is False
    assert device.get_device_capability() == (None, None)
    shim = device.get_torch_device()
    assert shim.is_available() is False and shim.device_count() == 0
    shim.empty_cache()
    shim.synchronize()
    assert shim.memory_allocated() == 0
    device.manual_seed(3)
    a = torch.rand(1)
    device.manual_seed_all(3)
    assert torch.equal(a, torch.rand(1))


def test_cuda_and_npu_selection(monkeypatch):
    monkeypatch.setattr(device, "is_cuda_available", True)
    assert device.get_device_name() == "cuda"
    assert device.get_nccl_backend() == "nccl"
    assert device.get_torch_device() is torch.cuda
    assert device.get_resource_name() == "GPU"
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", True)
    assert device.get_device_name() == "npu"
    assert device.get_nccl_backend() == "hccl"
    assert device.get_visible_devices_keyword() == "ASCEND_RT_VISIBLE_DEVICES"


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed")
def test_npu_probe_is_guarded():
    # without torch_npu the probe must say so without raising
    assert device.is_torch_npu_available(check_device=False) is False
    assert device.is_npu_available is False


def test_auto_set_device(monkeypatch, caplog):
    cfg = SimpleNamespace(trainer=SimpleNamespace(device="cpu"))
    monkeypatch.setattr(device, "is_cuda_available", True)
    device.auto_set_device(cfg)
    assert cfg.trainer.device == "cuda"
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", False)
    cfg.trainer.device = "cuda"
    with caplog.at_level("WARNING", logger=device.logger.name):
        device.auto_set_device(cfg)  # no GPU here: the run is on the CPU, and the user is told so
    assert cfg.trainer.device == "cpu"
    assert "trainer.device=cuda" in caplog.text and "runs on cpu" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger=device.logger.name):
        assert device.resolve_trainer_device("cpu") == "cpu"
    assert caplog.text == ""
    device.auto_set_device(None)
