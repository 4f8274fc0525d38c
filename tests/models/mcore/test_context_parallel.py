"""Context parallelism math on CPU (no megatron): the packed-row sharding is an exact inverse, and the CP forms of
packed causal attention, the Gated DeltaNet short conv (its halo crossing chunk boundaries) and the gated delta
rule (its state relayed from chunk to chunk) equal the unsharded computation, forward and backward, on 2 and 3
gloo processes."""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from verl.models.mcore.context_parallel import (
    CPShard, all_gather_cp, chunk_owner, cp_causal_attention, cp_pad_length, gather_to_full,
)
from verl.workers.engine.megatron.packing import pack_thd, unpack_thd

# Ragged, with sequences shorter than the conv halo per chunk (length 2 cp: one token a chunk) and long ones.
RAW_LENGTHS = [13, 1, 40, 6, 27]


def _bounds(cp, lengths=RAW_LENGTHS):
    out = [0]
    for n in lengths:
        out.append(out[-1] + cp_pad_length(n, cp))
    return out


# ------------------------------------------------------------------------------------------------ pure index math


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_layout_is_a_permutation_and_balanced(cp):
    bounds = _bounds(cp)
    shards = [CPShard.build(torch.tensor(bounds), cp, r) for r in range(cp)]
    every = torch.cat([s.local_index() for s in shards])
    assert sorted(every.tolist()) == list(range(bounds[-1]))  # each token on exactly one rank
    assert all(s.local_index().numel() == bounds[-1] // cp for s in shards)
    x = torch.randn(bounds[-1], 3)
    gathered = torch.cat([s.shard(x, 0) for s in shards])
    assert torch.equal(gathered.index_select(0, shards[0].gather_order), x)  # the unshard is the exact inverse
    for s in shards:  # rank r holds chunks r and 2cp-1-r of every sequence, in that order
        for i, m in enumerate(s.chunk_lens):
            lo = s.local_bounds[i]
            local = s.local_index()[lo: lo + 2 * m].tolist()
            want = [s.chunk_start(i, s.rank) + t for t in range(m)]
            want += [s.chunk_start(i, 2 * cp - 1 - s.rank) + t for t in range(m)]
            assert local == want
    assert [chunk_owner(j, 2) for j in range(4)] == [(0, 0), (1, 0), (1, 1), (0, 1)]


def test_shard_refuses_unpadded_sequences():
    with pytest.raises(ValueError, match="multiple of 4"):
        CPShard.build(torch.tensor([0, 6, 10]), 2, 0)


@pytest.mark.parametrize("cp,align", [(2, 1), (2, 2), (3, 1)])
def test_pack_thd_cp_roundtrip(cp, align):
    """Per-sequence CP padding keeps every real token and label, and unpacking restores the (B, L) layout."""
    gen = torch.Generator().manual_seed(0)
    bsz, seqlen = 4, 12
    lengths = [12, 0, 5, 9]
    mask = torch.zeros(bsz, seqlen, dtype=torch.long)
    for b, n in enumerate(lengths):
        if b % 2:  # left padded
            mask[b, seqlen - n:] = 1
        else:
            mask[b, :n] = 1
    ids = torch.randint(3, 50, (bsz, seqlen), generator=gen) * mask
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    packed = pack_thd(ids, mask, pos, align=align, cp=cp)
    cu = packed.cu_seqlens.tolist()
    assert packed.input_ids.shape[1] == cu[-1] and cu[-1] % (2 * cp * align) == 0
    assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu[:-1], cu[1:]))
    plain = pack_thd(ids, mask, pos)
    assert torch.equal(packed.input_ids[0, packed.token_index], plain.input_ids[0, : plain.num_real])
    assert torch.equal(packed.labels[0, packed.token_index], plain.labels[0, : plain.num_real])
    assert torch.equal(packed.position_ids[0, packed.token_index], plain.position_ids[0, : plain.num_real])
    values = torch.arange(cu[-1], dtype=torch.float32)[None]
    back = unpack_thd(values, packed, fill=-1.0)
    assert torch.equal(back[mask.bool()], values[0, packed.token_index])
    assert (back[~mask.bool()] == -1).all()
    CPShard.build(packed.cu_seqlens, cp, 0)  # a valid CP layout


# ------------------------------------------------------------------------------------------------ references


def _ref_attention(q, k, v, bounds, scale):
    rep = q.shape[1] // k.shape[1]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, kr, vr))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1))
    return torch.cat(out)


def _inputs(cp, seed=0):
    """Full-row tensors shared by every rank (same seed) and the random weights of the test loss."""
    g = torch.Generator().manual_seed(seed)
    bounds = _bounds(cp)
    t = bounds[-1]
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).float()  # noqa: E731
    return bounds, dict(
        q=r(t, 4, 8), k=r(t, 2, 8), v=r(t, 2, 8), w_att=r(t, 4, 8),
        x=r(1, t, 6), conv_w=r(6, 4) * 0.5, w_conv=r(1, t, 6),
        dq=r(1, t, 2, 8), dk=r(1, t, 2, 8), dv=r(1, t, 2, 8), gl=-torch.rand(1, t, 2, generator=g) * 0.5,
        beta=torch.rand(1, t, 2, generator=g), w_rule=r(1, t, 2, 8),
    )


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _check_attention(cp, rank, group):
    bounds, d = _inputs(cp)
    scale = 8 ** -0.5
    q, k, v = (_leaf(d[n]) for n in "qkv")
    ref = _ref_attention(q, k, v, bounds, scale)
    (ref * d["w_att"]).sum().backward()
    shard = CPShard.build(torch.tensor(bounds), cp, rank)
    ql, kl, vl = (_leaf(shard.shard(d[n], 0)) for n in "qkv")
    out = cp_causal_attention(ql, kl, vl, shard, group, scale)
    full = gather_to_full(out, shard, group, dim=0)
    torch.testing.assert_close(full, ref.detach(), atol=1e-5, rtol=1e-5)
    (full * d["w_att"]).sum().backward()
    for name, loc, glob in (("q", ql, q), ("k", kl, k), ("v", vl, v)):
        torch.testing.assert_close(loc.grad, shard.shard(glob.grad, 0), atol=1e-5, rtol=1e-5,
                                   msg=lambda s, n=name: f"attention d{n}: {s}")


def _check_conv(cp, rank, group):
    from verl.models.qwen3_5.gated_deltanet import torch_causal_conv1d
    from verl.models.qwen3_5.gated_deltanet_cp import cp_causal_conv1d

    bounds, d = _inputs(cp)
    cu = torch.tensor(bounds, dtype=torch.int32)
    x, w = _leaf(d["x"]), _leaf(d["conv_w"])
    ref = torch_causal_conv1d(x, w, None, cu, "silu")
    (ref * d["w_conv"]).sum().backward()
    shard = CPShard.build(cu, cp, rank)
    xl, wl = _leaf(shard.shard(d["x"], 1)), _leaf(d["conv_w"])
    out = cp_causal_conv1d(xl, wl, None, shard, group, "silu")
    torch.testing.assert_close(gather_to_full(out, shard, group, dim=1), ref.detach(), atol=1e-6, rtol=1e-5)
    (gather_to_full(out, shard, group, dim=1) * d["w_conv"]).sum().backward()
    torch.testing.assert_close(xl.grad, shard.shard(x.grad, 1), atol=1e-6, rtol=1e-5)
    wg = wl.grad.clone()
    dist.all_reduce(wg, group=group)  # a replicated weight: its grad is the sum of the ranks' (DDP over dp x cp)
    # the loss is replicated on the cp ranks, each rank's gradient is its tokens' share: the sum is the reference
    torch.testing.assert_close(wg, w.grad, atol=1e-5, rtol=1e-5)


def _check_delta_rule(cp, rank, group):
    from verl.models.qwen3_5.gated_deltanet import gated_delta_rule
    from verl.models.qwen3_5.gated_deltanet_cp import cp_gated_delta_rule

    bounds, d = _inputs(cp)
    cu = torch.tensor(bounds, dtype=torch.int32)
    names = ("dq", "dk", "dv", "gl", "beta")
    full = [_leaf(d[n]) for n in names]
    ref = gated_delta_rule(*full, cu_seqlens=cu, use_qk_l2norm=True)
    (ref * d["w_rule"]).sum().backward()
    shard = CPShard.build(cu, cp, rank)
    local = [_leaf(shard.shard(d[n], 1)) for n in names]
    with torch.no_grad():  # the inference path (no autograd function)
        plain = cp_gated_delta_rule(*local, shard, group)
    out = cp_gated_delta_rule(*local, shard, group)
    torch.testing.assert_close(plain, out.detach())
    got = gather_to_full(out, shard, group, dim=1)
    torch.testing.assert_close(got, ref.detach(), atol=2e-5, rtol=1e-4)
    (got * d["w_rule"]).sum().backward()
    for name, loc, glob in zip(names, local, full):
        torch.testing.assert_close(loc.grad, shard.shard(glob.grad, 1), atol=2e-5, rtol=1e-4,
                                   msg=lambda s, n=name: f"delta rule d{n}: {s}")


def _check_all_gather_backward(cp, rank, group):
    x = _leaf(torch.full((2, 3), float(rank + 1)))
    y = all_gather_cp(x, group)
    assert y.shape == (2 * cp, 3)
    (y * torch.arange(2 * cp, dtype=torch.float32)[:, None]).sum().backward()
    # every rank's consumer weights block r by (2r, 2r+1); summed over cp ranks
    want = torch.tensor([2.0 * rank, 2.0 * rank + 1])[:, None].expand(2, 3) * cp
    torch.testing.assert_close(x.grad, want)


def _worker(rank, init_file, result_dir, world):
    from tests.engine_utils import rank_report

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    with rank_report(result_dir, rank):
        group = dist.new_group(list(range(world)))  # a sub-group, as megatron's CP group is
        for check in (_check_all_gather_backward, _check_attention, _check_conv, _check_delta_rule):
            check(world, rank, group)


@pytest.mark.parametrize("world", [2, 3])
def test_cp_math_matches_unsharded(world):
    from tests.engine_utils import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_worker, world, tmp, world)


# ------------------------------------------------------------------------------------------------------------------
# The same relay on CUDA, where the delta rule is fla's chunk kernel (its initial-state and final-state gradients
# carry the relay): 2 GPUs, NCCL. fla computes in fp32 with tf32-class products, so it is held to a relative L2
# bound instead of the CPU test's elementwise one, and the figures are printed.
# ------------------------------------------------------------------------------------------------------------------

GPU_LENGTHS = [300, 1, 900, 64, 517]  # several fla chunks (64 tokens) per CP chunk, and one-token sequences


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _gpu_delta_rule_worker(rank, world, init_file, result_dir):
    from verl.models.qwen3_5.gated_deltanet import gated_delta_rule
    from verl.models.qwen3_5.gated_deltanet_cp import cp_gated_delta_rule

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    status = "ok"
    try:
        dev = torch.device("cuda", rank)
        bounds = _bounds(world, GPU_LENGTHS)
        t, heads, dim = bounds[-1], 4, 64
        gen = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
        # per-token log-decays of a few tenths (a trained model's range: the state lives over many tokens)
        data = dict(q=r(1, t, heads, dim), k=r(1, t, heads, dim), v=r(1, t, heads, dim),
                    g=(-torch.rand(1, t, heads, generator=gen) * 0.5).to(dev),
                    beta=torch.rand(1, t, heads, generator=gen).to(dev))
        weight = r(1, t, heads, dim)
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        full = [_leaf(x) for x in data.values()]
        ref = gated_delta_rule(*full, cu_seqlens=cu, use_qk_l2norm=True)
        (ref * weight).sum().backward()
        shard = CPShard.build(cu, world, rank)
        local = [_leaf(shard.shard(x, 1)) for x in data.values()]
        got = gather_to_full(cp_gated_delta_rule(*local, shard, None), shard, None, dim=1)
        (got * weight).sum().backward()
        report = {"out": _rel_l2(got.detach(), ref.detach())}
        for name, loc, glob in zip(data, local, full):
            report[f"d{name}"] = _rel_l2(loc.grad, shard.shard(glob.grad, 1))
        print(f"[cp delta rule, cuda, rank {rank}] relative L2 vs unsharded: "
              + ", ".join(f"{k} {v:.2e}" for k, v in report.items()), flush=True)
        bad = {k: v for k, v in report.items() if v > 5e-3}
        if bad:
            status = f"relative L2 above 5e-3: {bad}"
    except Exception as exc:
        import traceback

        status = f"{exc!r}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(status)
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp_delta_rule_on_cuda_matches_unsharded():
    pytest.importorskip("fla")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gpu_delta_rule_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        for rank in range(2):
            status = open(os.path.join(tmp, f"rank{rank}")).read()
            assert status == "ok", f"rank {rank}: {status}"
