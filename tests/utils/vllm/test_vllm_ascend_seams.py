"""vLLM-Ascend seams on CPU: MoE runtime layout, post-processing once, NZ check, NPU broadcast context."""

import contextlib

import pytest
import torch

from verl.utils.vllm import ascend_moe as am
from verl.utils.vllm.broadcast import broadcast_tensor

E, H, INTER = 4, 8, 6


def _hf_experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


class _Layer:
    """A FusedMoE-like layer already post-processed into runtime layout (per TP rank)."""

    def __init__(self, tp_size=1, experts=E):
        part = INTER // tp_size
        self.w13_weight = torch.nn.Parameter(torch.zeros(experts, H, 2 * part), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(experts, part, H), requires_grad=False)


def _ascend_post_process(layer):
    # What vLLM-Ascend's process_weights_after_loading does to expert weights: transpose to runtime layout.
    layer.w13_weight.data = layer.w13_weight.data.transpose(1, 2).contiguous()
    layer.w2_weight.data = layer.w2_weight.data.transpose(1, 2).contiguous()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_runtime_write_computes_like_hf(tp_size):
    gate_up, down = _hf_experts()
    x = torch.randn(3, H)
    total = torch.zeros(E, 3, H)
    for rank in range(tp_size):
        layer = _Layer(tp_size)
        am.write_runtime_experts(layer, gate_up, down, H, tp_rank=rank, tp_size=tp_size)
        assert layer.w13_weight.shape == (E, H, 2 * INTER // tp_size)  # [E, H, 2I]
        assert layer.w2_weight.shape == (E, INTER // tp_size, H)  # [E, I, H]
        # Grouped-matmul style compute in runtime layout: x @ w13 -> gate|up, act, @ w2; TP partial sums add up.
        gu = torch.einsum("th,ehk->etk", x, layer.w13_weight)
        g, u = gu.chunk(2, dim=-1)
        total += torch.einsum("eti,eih->eth", torch.nn.functional.silu(g) * u, layer.w2_weight)
    for e in range(E):
        g, u = torch.nn.functional.linear(x, gate_up[e]).chunk(2, dim=-1)
        want = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, down[e])
        torch.testing.assert_close(total[e], want, rtol=1e-5, atol=1e-5)


def test_expert_parallel_slice():
    gate_up, down = _hf_experts()
    layer = _Layer(experts=2)
    am.write_runtime_experts(layer, gate_up, down, H, expert_ids=[1, 3])
    torch.testing.assert_close(layer.w2_weight[1], down[3].T)


def test_colocated_path_is_not_post_processed_twice():
    gate_up, down = _hf_experts()
    layer = _Layer()
    am.write_runtime_experts(layer, gate_up, down, H)
    synced = layer.w13_weight.detach().clone()
    ran = am.PostLoadGuard("colocated").after_load([layer], _ascend_post_process)
    assert ran == 0 and torch.equal(layer.w13_weight, synced)
    assert am.layout_of(layer, H) == am.RUNTIME
    # A second, unguarded post-process is exactly the bug: it would transpose the synced weights back.
    _ascend_post_process(layer)
    assert am.layout_of(layer, H) == am.CHECKPOINT


def test_server_full_reload_post_processes_again():
    gate_up, down = _hf_experts()
    layer = _Layer()
    assert am.to_checkpoint_layout(layer, H)  # loader path: checkpoint layout first
    w13, w2 = am.shard_experts(gate_up, down)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    assert am.PostLoadGuard("reload").after_load([layer], _ascend_post_process) == 1
    assert am.layout_of(layer, H) == am.RUNTIME
    torch.testing.assert_close(layer.w13_weight.data, w13.transpose(1, 2))
    assert not am.to_checkpoint_layout(_CheckpointLayer(), H)


class _CheckpointLayer:
    w13_weight = torch.zeros(E, 2 * INTER, H)
    w2_weight = torch.zeros(E, H, INTER)


def test_runtime_write_refuses_wrong_layout_and_shapes():
    gate_up, down = _hf_experts()
    with pytest.raises(RuntimeError, match="runtime-layout"):
        am.write_runtime_experts(_CheckpointLayer(), gate_up, down, H)
    with pytest.raises(RuntimeError, match="tensor/expert parallel"):
        am.write_runtime_experts(_Layer(tp_size=2), gate_up, down, H)  # TP=2 layer, TP=1 write
    with pytest.raises(ValueError, match="divisible"):
        am.shard_experts(gate_up, down, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="mode"):
        am.PostLoadGuard("both")


@pytest.mark.parametrize("value", [None, "1", "true"])
def test_nz_must_be_disabled(value):
    env = {} if value is None else {am.NZ_ENV: value}
    with pytest.raises(RuntimeError, match="VLLM_ASCEND_ENABLE_NZ=0"):
        am.require_nz_disabled(env)
    am.require_nz_disabled({am.NZ_ENV: "0"})


class _FakeNpu:
    """Records device-context entry and hands out a stream object, like torch.npu."""

    def __init__(self):
        self.active = None
        self.log = []

    @contextlib.contextmanager
    def device(self, dev):
        self.active = dev
        try:
            yield
        finally:
            self.active = None

    def current_stream(self):
        return ("stream", self.active)


class _FakeComm:
    def __init__(self, npu):
        self.device = "npu:3"
        self.npu = npu
        self.calls = []

    def broadcast(self, tensor, src, stream=None):
        self.calls.append((src, stream, self.npu.active if self.npu else None))


def test_npu_broadcast_inside_device_context_on_current_stream():
    npu = _FakeNpu()
    comm = _FakeComm(npu)
    broadcast_tensor(comm, torch.zeros(2), src=0, device_module=npu, on_npu=True)
    assert comm.calls == [(0, ("stream", "npu:3"), "npu:3")]  # stream taken inside the context
    assert npu.active is None


def test_cpu_broadcast_is_plain():
    comm = _FakeComm(None)
    broadcast_tensor(comm, torch.zeros(2), src=1, on_npu=False)
    assert comm.calls == [(1, None, None)]


def test_runtime_expert_writer_intercepts_stream():
    gate_up, down = _hf_experts()
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    moe = torch.nn.Module()
    layer = _Layer()
    moe.w13_weight, moe.w2_weight = layer.w13_weight, layer.w2_weight
    mlp = torch.nn.Module()
    mlp.experts = moe
    model.model.mlp = mlp
    writer = am.RuntimeExpertWriter(model, H)
    assert writer.offer("model.mlp.experts.gate_up_proj", gate_up)
    assert writer._pending and not writer.layers
    with pytest.raises(RuntimeError, match="incomplete"):
        writer.finish()
    assert writer.offer("model.mlp.experts.down_proj", down)
    assert not writer.offer("model.norm.weight", torch.ones(H))
    writer.finish()
    assert writer.layers == [moe] and moe._verl_skip_post_process
    torch.testing.assert_close(moe.w2_weight.data, down.transpose(1, 2))
