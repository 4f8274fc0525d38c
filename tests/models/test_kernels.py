"""Missing fast kernels: a one-time warning on CUDA naming the package and the cost, a summary line always."""

import logging

import pytest
import torch

from verl.models import kernels
from verl.models.registry import SUPPORTED_ARCHITECTURES


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "_reported", set())


def _missing_all(monkeypatch):
    monkeypatch.setattr(kernels, "importable", lambda module: False)


def test_cuda_without_kernels_warns_once_per_package(monkeypatch, caplog, capsys):
    _missing_all(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA host, as far as the check can tell
    spec = SUPPORTED_ARCHITECTURES["Qwen3_5ForCausalLM"]
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        status = kernels.report_kernels(spec, use_remove_padding=True)
        kernels.report_kernels(spec, use_remove_padding=True)
    assert status == {"fla": False, "causal_conv1d": False, "flash_attn": False}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # once each, not again on the second engine
    for pkg in ("flash-linear-attention", "causal-conv1d", "flash-attn"):
        assert sum(f"pip install {pkg}`" in w for w in warnings) == 1
    assert all("without it" in w for w in warnings)
    out = capsys.readouterr().out
    assert out.count("[verl.kernels]") == 1 and "on cuda" in out and "flash-linear-attention=no" in out


def test_cpu_reports_but_does_not_warn(monkeypatch, caplog, capsys):
    _missing_all(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        kernels.report_kernels(SUPPORTED_ARCHITECTURES["Qwen3_5MoeForCausalLM"], use_remove_padding=False)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    out = capsys.readouterr().out
    assert "on cpu" in out and "flash-attn" not in out  # padded: the packed-attention kernel is not needed


def test_installed_kernel_is_reported_in_use(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "importable", lambda module: module == "fla")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        status = kernels.report_kernels(SUPPORTED_ARCHITECTURES["Qwen3_5ForCausalLM"], True, on_cuda=True)
    assert status["fla"] and not status["flash_attn"]
    assert not any("flash-linear-attention" in r.getMessage() for r in caplog.records)


def test_engine_reports_kernels_at_build(monkeypatch, tmp_path):
    """The FSDP engine consults the kernel report when it builds the model (the run's first log lines)."""
    from omegaconf import OmegaConf

    from tests.engine_utils import single_rank_gloo
    from verl.models.tiny import build_tiny_qwen3_5
    from verl.workers.engine.fsdp.model_init import build_module

    build_tiny_qwen3_5(str(tmp_path), kind="dense", with_tokenizer=False)
    seen = []
    monkeypatch.setattr(kernels, "report_kernels", lambda spec, rmpad, **kw: seen.append((spec.architecture, rmpad)))
    with single_rank_gloo():
        build_module(OmegaConf.create({"path": str(tmp_path), "use_remove_padding": True}), {}, role="ref")
    assert seen == [("Qwen3_5ForCausalLM", True)]
