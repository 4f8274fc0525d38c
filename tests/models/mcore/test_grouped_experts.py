"""Grouped-GEMM MoE experts (verl/models/mcore/grouped_experts.py) against megatron-core's SequentialMLP with the
same parameters: outputs and every gradient equal, uneven and empty experts included; unsupported settings fall
back to the loop. Needs megatron-core (skipped where it does not import: the CPU CI; runs on the GPU machine and
on a CPU with megatron-core's source on PYTHONPATH, where torch._grouped_mm runs in fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (the mcore extra)")


@pytest.fixture(scope="module")
def experts_pair():
    import mcore_parity as mp
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from verl.models.mcore.grouped_experts import GroupedGemmExperts

    mp.init_single_process("cpu")
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
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


def test_unsupported_settings_fall_back_to_the_loop(experts_pair, monkeypatch):
    _, grp = experts_pair
    monkeypatch.setattr(grp.config, "add_bias_linear", True)
    assert grp._unsupported(torch.zeros(1, 32)) == "expert biases"
    monkeypatch.setattr(grp.config, "add_bias_linear", False)
    monkeypatch.setattr(grp.config, "gated_linear_unit", False)
    assert "SwiGLU" in grp._unsupported(torch.zeros(1, 32))
