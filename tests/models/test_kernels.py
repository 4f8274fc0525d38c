"""Kernel report: what the code will run (asked of the code that chooses), a one-time warning on CUDA naming the
package and the cost for each slow fallback only, and the summary line."""

import importlib.machinery
import importlib.util
import logging
import sys
import types

import pytest
import torch

from verl.models import kernels
from verl.models.registry import SUPPORTED_ARCHITECTURES, get_model_spec
from verl.models.qwen3_5 import gated_deltanet
from verl.models.transformers import packed_attention

QWEN = SUPPORTED_ARCHITECTURES["Qwen3_5ForCausalLM"]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "_reported", set())
    monkeypatch.delenv(gated_deltanet.GDN_BACKEND_ENV, raising=False)
    monkeypatch.delenv(packed_attention.BACKEND_ENV, raising=False)


def _kernels(monkeypatch, fla=False, conv=False, flash=False, torch_varlen=False):
    """Stand-ins for what is installed: the report and the forwards read the same switches."""
    monkeypatch.setattr(gated_deltanet, "_fla_functions", lambda: (object(), object()) if fla else None)
    monkeypatch.setattr(packed_attention, "_flash_varlen", lambda: object() if flash else None)
    monkeypatch.setattr(packed_attention, "_torch_varlen", lambda: (object(), frozenset()) if torch_varlen else None)
    real = kernels.importable
    monkeypatch.setattr(kernels, "importable", lambda module: conv if module == "causal_conv1d" else real.__wrapped__(module))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_cuda_without_any_kernel_warns_once_per_package(monkeypatch, caplog, capsys):
    _kernels(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA host, as far as the check can tell
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        packed = kernels.report_kernels(QWEN, use_remove_padding=True)
        kernels.report_kernels(QWEN, use_remove_padding=True)
        padded = kernels.report_kernels(QWEN, use_remove_padding=False)
    # packed forwards (and the hf rollout's decode runner) never call transformers' own conv; padded ones do
    assert {k: (c.backend, c.slow) for k, c in packed.items()} == {
        "gated_deltanet": ("torch", True), "packed_attention": ("sdpa", True)}
    assert {k: (c.backend, c.slow) for k, c in padded.items()} == {
        "gated_deltanet": ("torch", True), "stock_gdn_conv": ("torch", True)}
    warnings = _warnings(caplog)
    assert len(warnings) == 3  # once each, not again on the second engine
    for pkg in ("flash-linear-attention", "causal-conv1d", "flash-attn"):
        assert sum(f"pip install {pkg}`" in w for w in warnings) == 1
    assert all("without it" in w for w in warnings)
    out = capsys.readouterr().out
    assert out.count("[verl.kernels]") == 2 and "on cuda" in out and "gated_deltanet=torch" in out


def test_torch_varlen_attention_is_reported_and_not_warned(monkeypatch, caplog, capsys):
    """Without flash-attn, packed attention runs torch's own varlen kernel (torch >= 2.10): fast, so no warning."""
    _kernels(monkeypatch, fla=True, conv=True, torch_varlen=True)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        choices = kernels.report_kernels(QWEN, True, on_cuda=True)
    assert choices["packed_attention"].backend == "torch_varlen" and not choices["packed_attention"].slow
    assert choices["packed_attention"].backend == packed_attention.select_backend(fast=True)
    assert choices["gated_deltanet"].backend == "fla"
    assert _warnings(caplog) == []
    assert "packed_attention=torch_varlen" in capsys.readouterr().out


def test_flash_attn_preferred(monkeypatch):
    _kernels(monkeypatch, fla=True, conv=True, flash=True, torch_varlen=True)
    assert kernels.kernel_choices(QWEN, True, on_cuda=True)["packed_attention"].backend == "flash_attn"


def test_broken_fla_install_reports_torch(monkeypatch, caplog):
    """An fla that is installed but fails to import (wrong triton/CUDA build) is what the forwards treat as absent:
    the report must say torch, and warn, rather than claim fla from the files on disk."""
    broken = types.ModuleType("fla")
    broken.__path__ = []  # a package whose submodule import fails, as a broken build's does
    broken.__spec__ = importlib.machinery.ModuleSpec("fla", None, is_package=True)  # found by find_spec
    monkeypatch.setitem(sys.modules, "fla", broken)
    monkeypatch.setitem(sys.modules, "fla.ops", None)  # import of fla.ops raises ImportError
    assert importlib.util.find_spec("fla") is not None  # a look-up of installed files says "there"
    gated_deltanet._fla_functions.cache_clear()
    kernels.importable.cache_clear()
    try:
        assert gated_deltanet.gdn_backend("cuda") == "torch"
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            choice = kernels.report_kernels(QWEN, False, on_cuda=True)["gated_deltanet"]
        assert (choice.backend, choice.slow) == ("torch", True)
        assert any("flash-linear-attention" in w for w in _warnings(caplog))
    finally:
        gated_deltanet._fla_functions.cache_clear()
        kernels.importable.cache_clear()


def test_forced_backends_are_reported_not_warned(monkeypatch, caplog):
    _kernels(monkeypatch, fla=True)
    monkeypatch.setenv(gated_deltanet.GDN_BACKEND_ENV, "torch")
    monkeypatch.setenv(packed_attention.BACKEND_ENV, "sdpa")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        choices = kernels.report_kernels(QWEN, True, on_cuda=True)
    assert choices["gated_deltanet"].backend.startswith("torch (VERL_GDN_BACKEND")
    assert choices["packed_attention"].backend.startswith("sdpa (VERL_PACKED_ATTN_BACKEND")
    assert not any("flash-linear-attention" in w or "flash-attn`" in w for w in _warnings(caplog))


def test_cpu_reports_but_does_not_warn(monkeypatch, caplog, capsys):
    _kernels(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        kernels.report_kernels(SUPPORTED_ARCHITECTURES["Qwen3_5MoeForCausalLM"], use_remove_padding=False)
    assert _warnings(caplog) == []
    out = capsys.readouterr().out
    assert "on cpu" in out and "packed_attention" not in out  # padded: the packed-attention kernel is not needed


def test_generic_model_packs_through_hf_flash_attention():
    import transformers as tf

    spec = get_model_spec(tf.LlamaConfig(architectures=["LlamaForCausalLM"]))
    choices = kernels.kernel_choices(spec, True, on_cuda=True)
    assert list(choices) == ["packed_attention"] and "flash_attention_2" in choices["packed_attention"].backend


def test_mcore_engine_report(monkeypatch, caplog, capsys):
    """The Megatron model runs the same Gated DeltaNet kernels, its own attention, and no stock HF forward."""
    _kernels(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        choices = kernels.report_kernels(QWEN, True, on_cuda=True, engine="mcore")
    assert set(choices) == {"gated_deltanet", "packed_attention"} and choices["gated_deltanet"].slow
    (warning,) = _warnings(caplog)  # no causal-conv1d or flash-attn warning: the mcore model uses neither
    assert "pip install flash-linear-attention`" in warning
    assert "(mcore) on cuda" in capsys.readouterr().out
    # packed full attention: the FSDP path's varlen choice (one kernel per packed row), else SDPA per sequence
    from verl.models.transformers.packed_attention import BACKEND_ENV, select_backend

    fast = select_backend(fast=True)
    want = "sdpa per sequence (local spec)" if fast == "sdpa" else f"{fast} (local spec)"
    assert choices["packed_attention"].backend == want
    monkeypatch.setenv(BACKEND_ENV, "sdpa")
    forced = kernels.kernel_choices(QWEN, True, on_cuda=True, engine="mcore")
    assert forced["packed_attention"].backend == "sdpa per sequence (local spec)"


def test_engine_reports_kernels_at_build(monkeypatch, tmp_path):
    """The FSDP engine consults the kernel report when it builds the model (the run's first log lines)."""
    from omegaconf import OmegaConf

    from tests.engine_utils import single_rank_gloo
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.workers.engine.fsdp.model_init import build_module

    build_tiny_qwen3_5(str(tmp_path), kind="dense", with_tokenizer=False)
    seen = []
    monkeypatch.setattr(kernels, "report_kernels", lambda spec, rmpad, **kw: seen.append((spec.architecture, rmpad)))
    with single_rank_gloo():
        build_module(OmegaConf.create({"path": str(tmp_path), "use_remove_padding": True}), {}, role="ref")
    assert seen == [("Qwen3_5ForCausalLM", True)]
