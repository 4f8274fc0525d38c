"""Grouped-GEMM MoE experts (verl/models/mcore/grouped_experts.py) against megatron-core's SequentialMLP with the
same parameters: outputs and every gradient equal, uneven and empty experts included, with expert tensor
parallelism 1 and 2 (two CPU ranks); unsupported settings fall back to the loop. Needs megatron-core (skipped
where it does not import: the CPU CI; runs on the GPU machine and on a CPU with megatron-core's source on
PYTHONPATH, where torch._grouped_mm runs in fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (the mcore extra)")


def _pair(hidden: int = 32):
    """SequentialMLP and GroupedGemmExperts with the same parameters, in the initialised parallel state."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from verl.models.mcore.grouped_experts import GroupedGemmExperts

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=64,
                            moe_ffn_hidden_size=16, num_moe_experts=4, gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, bias_activation_fusion=False, params_dtype=torch.float32,
                            use_cpu_initialization=True)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    seq = SequentialMLP(4, cfg, sub, pg_collection=pg)
    grp = GroupedGemmExperts(4, cfg, sub, pg_collection=pg)
    grp.load_state_dict(seq.state_dict())
    assert set(grp.state_dict()) == set(seq.state_dict())  # the same parameters: checkpoints see no difference
    return seq, grp


@pytest.fixture(scope="module")
def experts_pair():
    import mcore_parity as mp

    mp.init_single_process("cpu")
    return _pair()


def _run(module, x, tpe, probs):
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out, bias = module(x, tpe, probs)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("tokens_per_expert", [[3, 0, 5, 2], [10, 0, 0, 0], [1, 2, 3, 4]])
def test_grouped_experts_equal_the_sequential_loop(experts_pair, tokens_per_expert):
    seq, grp = experts_pair
    assert grp._unsupported(torch.zeros(1, 32)) is None  # the grouped path really runs
    g = torch.Generator().manual_seed(1)
    n = sum(tokens_per_expert)
    x, probs = torch.randn(n, 32, generator=g), torch.rand(n, generator=g)
    tpe = torch.tensor(tokens_per_expert)
    want, gx_want, gp_want = _run(seq, x, tpe, probs)
    got, gx_got, gp_got = _run(grp, x, tpe, probs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx_got, gx_want, atol=1e-5, rtol=1e-5)
    assert set(gp_got) == set(gp_want)
    for name in gp_want:
        torch.testing.assert_close(gp_got[name], gp_want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_expert_gradients_arrive_without_a_copy_per_expert(experts_pair):
    """Each expert's weight gradient is a contiguous slice of one stacked gradient (what autograd hands to the
    parameter as is): no strided copy per expert and micro-batch before megatron-core's main_grad accumulation."""
    _, grp = experts_pair
    g = torch.Generator().manual_seed(2)
    x, probs, tpe = torch.randn(12, 32, generator=g), torch.rand(12, generator=g), torch.tensor([3, 4, 0, 5])
    grp.zero_grad(set_to_none=True)
    out, _ = grp(x.requires_grad_(True), tpe, probs)
    out.backward(torch.randn(out.shape, generator=g))
    for proj in ("linear_fc1", "linear_fc2"):
        grads = [getattr(e, proj).weight.grad for e in grp.local_experts]
        assert all(gr.is_contiguous() for gr in grads)
        assert len({gr.untyped_storage().data_ptr() for gr in grads}) == 1, proj  # views of one stacked gradient


def _ddp_like(module):
    """megatron-core DDP's view of each parameter: an fp32 ``main_grad``, the ``grad_added_to_main_grad`` flag
    and its post-accumulation hook (add ``param.grad`` into ``main_grad`` unless the flag says it is there)."""
    for p in module.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False

        def hook(param):
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


def test_expert_gradients_accumulate_into_main_grad_over_micro_batches(experts_pair, monkeypatch):
    """Under DDP the grouped path adds each expert's gradient into its main_grad itself (a few multi-tensor adds
    per projection, DDP's hook told to skip its own): over two micro-batches the main_grads equal the
    SequentialMLP's, chunked adds included, and no gradient is left on the parameters."""
    from verl.models.mcore import grouped_experts

    monkeypatch.setattr(grouped_experts, "_ACCUMULATE_CHUNK", 3)  # 4 experts: a full chunk and a partial one
    seq, grp = _pair()  # fresh ones (the fixture's keep no hooks), in the fixture's parallel state
    _ddp_like(seq)
    _ddp_like(grp)
    g = torch.Generator().manual_seed(3)
    for tpe in ([3, 4, 0, 5], [1, 0, 6, 2]):
        n = sum(tpe)
        x, probs, dy = torch.randn(n, 32, generator=g), torch.rand(n, generator=g), torch.randn(n, 32, generator=g)
        for m in (seq, grp):
            out, _ = m(x, torch.tensor(tpe), probs)
            out.backward(dy)
    assert all(p.grad_added_to_main_grad for p in grp.parameters())
    assert not any(p.grad_added_to_main_grad for p in seq.parameters())  # the loop leaves it to the hook
    for (name, a), (_, b) in zip(seq.named_parameters(), grp.named_parameters()):
        assert b.grad is None
        assert a.main_grad.abs().sum() > 0, name
        torch.testing.assert_close(b.main_grad, a.main_grad, atol=1e-5, rtol=1e-5, msg=name)


def _etp_rank(rank: int, port: int, out: str) -> None:
    """One of two CPU ranks with expert tensor parallelism 2: each holds half of every expert's FFN columns."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=2)
    seq, grp = _pair()
    assert grp.tp_group.size() == 2 and grp._unsupported(torch.zeros(1, 32)) is None
    assert grp.local_experts[0].linear_fc1.weight.shape[0] == 16  # 2 x 16 FFN columns / 2 ranks
    g = torch.Generator().manual_seed(1)  # the same tokens on both ranks: what the dispatcher's gather leaves
    x, probs = torch.randn(10, 32, generator=g), torch.rand(10, generator=g)
    tpe = torch.tensor([3, 0, 5, 2])
    want, got = _run(seq, x, tpe, probs), _run(grp, x, tpe, probs)
    weights = [(e.linear_fc1.weight.detach(), e.linear_fc2.weight.detach()) for e in grp.local_experts]
    torch.save(dict(want=want, got=got, weights=weights, x=x, probs=probs, tpe=tpe), f"{out}.{rank}")
    dist.destroy_process_group()


def test_grouped_experts_equal_the_sequential_loop_with_expert_tensor_parallelism(tmp_path):
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    port = 29700 + __import__("os").getpid() % 200
    procs = [ctx.Process(target=_etp_rank, args=(r, port, str(tmp_path / "r"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in range(2):
        r = torch.load(tmp_path / f"r.{rank}")
        (want, gx_want, gp_want), (got, gx_got, gp_got) = r["want"], r["got"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx_got, gx_want, atol=1e-5, rtol=1e-5)
        for name in gp_want:
            torch.testing.assert_close(gp_got[name], gp_want[name], atol=1e-5, rtol=1e-5, msg=name)
    # each rank's output is its partial sum over its FFN shard (the dispatcher reduce-scatters them): the two add
    # up to the unsharded SwiGLU experts' output (gate and up halves of each rank's fc1 shard side by side)
    r0, r1 = torch.load(tmp_path / "r.0"), torch.load(tmp_path / "r.1")
    x, probs = r0["x"], r0["probs"]
    rows = torch.repeat_interleave(torch.arange(4), r0["tpe"])
    full = torch.zeros_like(r0["got"][0])
    for i in range(len(x)):
        (a0, b0), (a1, b1) = r0["weights"][rows[i]], r1["weights"][rows[i]]
        gate = torch.cat([a0.chunk(2)[0], a1.chunk(2)[0]])
        up = torch.cat([a0.chunk(2)[1], a1.chunk(2)[1]])
        h = torch.nn.functional.silu(gate @ x[i]) * (up @ x[i]) * probs[i]
        full[i] = torch.cat([b0, b1], dim=1) @ h
    assert not torch.allclose(r0["got"][0], r1["got"][0])
    torch.testing.assert_close(r0["got"][0] + r1["got"][0], full, atol=1e-5, rtol=1e-5)


def test_unsupported_settings_fall_back_to_the_loop(experts_pair, monkeypatch):
    _, grp = experts_pair
    monkeypatch.setattr(grp.config, "add_bias_linear", True)
    assert grp._unsupported(torch.zeros(1, 32)) == "expert biases"
    monkeypatch.setattr(grp.config, "add_bias_linear", False)
    monkeypatch.setattr(grp.config, "gated_linear_unit", False)
    assert "SwiGLU" in grp._unsupported(torch.zeros(1, 32))
