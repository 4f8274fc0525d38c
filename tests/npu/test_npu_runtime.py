"""Ascend NPU runtime checks (``pytest -m npu`` on an NPU runner; .github/workflows/npu-tests.yml).

The CPU suite covers the same seams with stand-ins (tests/models/test_npu_patch.py: a fake torch_npu computing
the reference maths; tests/models/test_npu_patch_call_site.py: a simulated NPU device; tests/utils/vllm/:
fake vLLM-Ascend layers). Here the real torch_npu kernels, HCCL and vLLM-Ascend run. Not run on this
project's CPU CI: no NPU is available there.
"""

import multiprocessing as mp
import os

import pytest
import torch

pytestmark = pytest.mark.npu

SEQ = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def test_device_utils_detect_the_npu():
    from verl.utils.device import get_device_name, get_nccl_backend, is_vllm_ascend_available

    assert get_device_name() == "npu" and get_nccl_backend() == "hccl"
    import importlib.util

    assert is_vllm_ascend_available() == (importlib.util.find_spec("vllm_ascend") is not None)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_model_load_applies_patches_and_matches_reference(tmp_path, kind):
    from verl.models.registry import load_hf_model
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.models.qwen3_5 import npu_patch

    build_tiny_qwen3_5(tmp_path, kind=kind, dtype=torch.float32)
    npu_patch.revert_npu_patches()
    reference = load_hf_model(str(tmp_path), dtype=torch.float32)  # patched by the load itself: revert below
    npu_patch.revert_npu_patches()
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        ref_logits = reference(input_ids=ids).logits  # stock forward, on CPU

    model = load_hf_model(str(tmp_path), dtype=torch.float32).to("npu")
    try:
        mod = __import__(f"transformers.models.{kind == 'moe' and 'qwen3_5_moe' or 'qwen3_5'}."
                         f"modeling_{kind == 'moe' and 'qwen3_5_moe' or 'qwen3_5'}", fromlist=["x"])
        norm = getattr(mod, "Qwen3_5MoeRMSNorm" if kind == "moe" else "Qwen3_5RMSNorm")
        assert norm.forward is npu_patch.zero_centered_rms_norm_forward  # applied by load_hf_model
        with torch.no_grad():
            logits = model(input_ids=ids.to("npu")).logits.cpu()
        torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=2e-3)
    finally:
        npu_patch.revert_npu_patches()


def test_ascend_runtime_expert_write_on_device():
    from verl.utils.vllm import ascend_moe as am

    E, H, inter = 4, 16, 8
    gate_up, down = torch.randn(E, 2 * inter, H), torch.randn(E, H, inter)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(E, H, 2 * inter, device="npu"), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(E, inter, H, device="npu"), requires_grad=False)
    am.write_runtime_experts(layer, gate_up.npu(), down.npu(), hidden_size=H)
    w13, w2 = am.to_runtime_layout(*am.shard_experts(gate_up, down))
    torch.testing.assert_close(layer.w13_weight.cpu(), w13)
    torch.testing.assert_close(layer.w2_weight.cpu(), w2)


def _hccl_peer(store_path, out):
    import torch_npu  # noqa: F401

    from verl.utils.vllm.broadcast import PairCommunicator, broadcast_tensor

    torch.npu.set_device(1)
    store = torch.distributed.FileStore(store_path, 2)
    comm = PairCommunicator("hccl", store, rank=1, world_size=2, device=torch.device("npu", 1))
    t = torch.empty(1024, device="npu:1")
    broadcast_tensor(comm, t, src=0)
    out.put(float(t.sum().cpu()))


def test_hccl_pair_broadcast_lands_in_device_buffers(tmp_path):
    if torch.npu.device_count() < 2:
        pytest.skip("needs two NPUs (one per side of the pair)")
    from verl.utils.vllm.broadcast import PairCommunicator, broadcast_tensor

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store_path = str(tmp_path / "store")
    peer = ctx.Process(target=_hccl_peer, args=(store_path, out))
    peer.start()
    torch.npu.set_device(0)
    comm = PairCommunicator("hccl", torch.distributed.FileStore(store_path, 2), rank=0, world_size=2,
                            device=torch.device("npu", 0))
    src = torch.arange(1024, dtype=torch.float32, device="npu:0")
    broadcast_tensor(comm, src, src=0)
    assert out.get(timeout=120) == pytest.approx(float(src.sum().cpu()))
    peer.join(60)


@pytest.mark.parametrize("standalone", [False, True], ids=["colocated", "server"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_vllm_ascend_sync_matches_a_fresh_engine(tmp_path, kind, standalone):
    """Colocated: fused MoE experts are written straight into vLLM-Ascend's runtime layout. Server
    (``standalone=True``, what a rollout server process builds): every full sync is a checkpoint-format reload,
    after which the MoE layers the loader left in checkpoint layout are post-processed again
    (``_post_process_reloaded_experts``). Either way the synced engine must score like a fresh one."""
    pytest.importorskip("vllm_ascend")
    os.environ.setdefault("VLLM_ASCEND_ENABLE_NZ", "0")
    from tests.vllm_testing import fresh_engine_scores, model_config, rollout_config, sgd_step, trainer_logprobs
    from tests.vllm_testing import build_engine_checkpoint
    from verl.workers.rollout.vllm_rollout.vllm_rollout import uses_runtime_expert_writer, vLLMRollout
    from verl.workers.weight_sync import iter_hf_weights

    hf = build_engine_checkpoint(tmp_path / "m", kind)
    rollout = vLLMRollout(rollout_config(free_cache_engine=False), model_config(tmp_path / "m"), tokenizer=None,
                          standalone=standalone)
    post_processed = []
    original = rollout._post_process_reloaded_experts
    rollout._post_process_reloaded_experts = lambda: (post_processed.append(True), original())[1]
    try:
        assert rollout.ascend and rollout.layout.expert_format == "per_expert"  # vLLM-Ascend names chosen
        assert rollout.full_reload is standalone
        writer = uses_runtime_expert_writer(rollout.layout, ascend=True, standalone=standalone)
        assert writer is (kind == "moe" and not standalone)
        sgd_step(hf, SEQ, lr=0.3)
        rollout.update_weights(iter_hf_weights(hf, dtype=torch.bfloat16))
        synced = torch.tensor(rollout.score([SEQ])[0])
    finally:
        rollout.shutdown()
    # the server-side reload path (post-load processing after a checkpoint-format reload) ran for MoE only
    assert post_processed == ([True] if kind == "moe" and standalone else [])
    fresh = fresh_engine_scores(hf, tmp_path / "m", tmp_path / "fresh", SEQ)
    assert (synced - fresh).abs().max().item() < 0.05
    assert (synced - trainer_logprobs(hf, SEQ)).abs().max().item() < 0.1
