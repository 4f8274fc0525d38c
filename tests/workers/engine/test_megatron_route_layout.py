"""Router replay on the Megatron engine, the layout seam (CPU, no megatron-core): the batch's ``routed_experts``
(B, L, moe_layers, top_k) -> the per-layer top-k tensors each megatron-core router sees (packed THD order with
alignment padding, or the unpacked [S, B] order; this tensor rank's sequence-parallel slice; this pipeline
stage's MoE layers), and the recorded routes back into the batch layout (R2)."""

import pytest
import torch
from tensordict import TensorDict

from verl.workers.engine.megatron.packing import pack_thd
from verl.workers.engine.megatron.route_layout import (
    join_shards,
    moe_slots,
    routes_for_router,
    routes_to_batch,
    sequence_shard,
    token_index,
)

E, K, M = 8, 2, 4  # experts, top-k, MoE layers


def _ragged(bsz=5, seqlen=8, seed=0, left=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, seqlen + 1, (bsz,), generator=g)
    lengths[0] = seqlen  # one full row, and (with seed 0) an empty one
    ar = torch.arange(seqlen)
    mask = (ar[None] >= seqlen - lengths[:, None]) if left else (ar[None] < lengths[:, None])
    mask = mask.long()
    ids = torch.randint(1, 100, (bsz, seqlen), generator=g) * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bsz * seqlen * M)])
    routes = routes.view(bsz, seqlen, M, K).to(torch.int16)
    routes[~mask.bool()] = -1
    return ids, mask, pos, routes


def _router_view(routes, mask, ids, pos, tp, pp_slots, packed=True):
    """What every (tp rank, pipeline stage) router is handed, and the token index, as the engine computes them."""
    bsz, seqlen = ids.shape
    if packed:
        p = pack_thd(ids, mask, pos, align=tp)
        index = token_index(bsz, seqlen, p.indices, p.input_ids.shape[-1])
    else:
        index = token_index(bsz, seqlen)
    shards = {(r, s): routes_for_router(routes, sequence_shard(index, r, tp), slots, K)
              for r in range(tp) for s, slots in enumerate(pp_slots)}
    return index, shards


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_thd_order_and_sp_slices_match_the_packed_tokens(tp, left):
    ids, mask, pos, routes = _ragged(left=left)
    p = pack_thd(ids, mask, pos, align=tp)
    index = token_index(*ids.shape, p.indices, p.input_ids.shape[-1])
    assert index.numel() == p.input_ids.shape[-1] and index.numel() % tp == 0
    # the index names, for every packed position, the padded position its token came from
    real = index >= 0
    assert torch.equal(ids.reshape(-1)[index[real]], p.input_ids[0, real])
    assert not real[p.num_real:].any() and real[:p.num_real].all()
    # rank r's router sees the r-th contiguous slice of the packed row (megatron's scatter on dim 0)
    parts = [sequence_shard(index, r, tp) for r in range(tp)]
    assert torch.equal(torch.cat(parts), index)
    for r, part in enumerate(parts):
        got = routes_for_router(routes, part, [0, 3], K)
        ok = part >= 0
        assert torch.equal(got[1][ok], routes.reshape(-1, M, K)[part[ok], 3].long())
        assert (got[0][~ok] == torch.arange(K)).all()  # alignment padding: experts 0..k-1


def test_unpacked_order_is_position_major_and_padding_gets_filler():
    ids, mask, pos, routes = _ragged(bsz=3, seqlen=4, seed=2)
    index = token_index(3, 4)
    # megatron's [S, B] activations flattened: token (s, b) at s * B + b
    assert torch.equal(ids.reshape(-1)[index], ids.t().reshape(-1))
    got = routes_for_router(routes, index, [1], K)[0]
    flat_mask = mask.t().reshape(-1).bool()
    assert torch.equal(got[flat_mask], routes.transpose(0, 1).reshape(-1, M, K)[flat_mask, 1].long())
    assert (got[~flat_mask] == torch.arange(K)).all()


def test_a_real_token_without_route_takes_the_filler():
    """The rollout leaves -1 at the last response token (never fed back); megatron-core replays whole layers, so
    that token takes experts 0..k-1 in every layer (its logits predict past the response: nothing scored)."""
    ids, mask, pos, routes = _ragged(bsz=2, seqlen=6, seed=3)
    routes[0, 5] = -1
    p = pack_thd(ids, mask, pos)
    index = token_index(2, 6, p.indices, p.input_ids.shape[-1])
    got = routes_for_router(routes, index, list(range(M)), K)
    at = (index == 5).nonzero().item()
    assert all(g[at].tolist() == list(range(K)) for g in got)
    assert all(g.dtype == torch.int64 for g in got)  # gather indices


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("tp,pp_slots", [(1, [[0, 1, 2, 3]]), (2, [[0, 1, 2, 3]]), (2, [[0, 1], [2, 3]]),
                                          (4, [[0], [1, 2], [3]])])
def test_recorded_routes_return_to_the_batch_exactly(tp, pp_slots, packed):
    """R2: each (tensor rank, stage) records its routers' view; joining the tensor ranks, merging the stages and
    scattering back gives the batch's routes exactly (-1 at padding), on a ragged batch."""
    ids, mask, pos, routes = _ragged(seed=4)
    if not packed and ids.shape[1] % tp:
        pytest.skip("unpacked sequence parallelism needs L divisible by tp")
    index, shards = _router_view(routes, mask, ids, pos, tp, pp_slots, packed=packed)
    merged: dict = {}
    for s, slots in enumerate(pp_slots):
        per_rank = [{0: dict(zip(slots, shards[(r, s)]))} for r in range(tp)]  # micro-batch 0
        for mb, rec in join_shards(per_rank).items():
            merged.setdefault(mb, {}).update(rec)
    back = routes_to_batch(merged[0], index, mask, M)
    assert back.dtype == torch.int16 and back.shape == routes.shape
    assert torch.equal(back, routes)


def test_micro_batches_and_dynamic_batching_round_trip():
    """Routes travel with their rows through token-budget micro-batches; per micro-batch forward seam + inverse,
    reassembled in the engine's order, give the batch back."""
    from verl.workers.engine.megatron.engine import MegatronEngine
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    ids, mask, pos, routes = _ragged(bsz=8, seqlen=7, seed=5)
    batch = TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": pos, "routed_experts": routes},
                       batch_size=[8])
    tds, groups = rearrange_micro_batches(batch, max_token_len=16)
    assert len(tds) > 1
    collected = []
    for i, td in enumerate(tds):
        index, shards = _router_view(td["routed_experts"], td["attention_mask"], td["input_ids"],
                                     td["position_ids"], 2, [[0, 1, 2, 3]])
        rec = join_shards([{i: dict(enumerate(shards[(r, 0)]))} for r in range(2)])[i]
        collected.append((i, {"routed_experts": routes_to_batch(rec, index, td["attention_mask"], M)}))
    out = MegatronEngine._assemble(None, collected[::-1], groups, {"routed_experts"})
    assert out["routed_experts"].dtype == torch.int16
    assert torch.equal(out["routed_experts"], routes)


def test_moe_slots_number_layers_across_stages():
    assert moe_slots([[1, 2], [3, 4]]) == {1: 0, 2: 1, 3: 2, 4: 3}
    # interleaved chunks on a rank, and dense layers between MoE ones
    assert moe_slots([[1, 5], [3], [7, 8]]) == {1: 0, 3: 1, 5: 2, 7: 3, 8: 4}
    with pytest.raises(ValueError, match="same decoder layer"):
        moe_slots([[1, 2], [2]])


def test_bad_shapes_are_named():
    ids, mask, pos, routes = _ragged(bsz=2, seqlen=4, seed=6)
    index = token_index(2, 4)
    with pytest.raises(ValueError, match="top_k=2"):
        routes_for_router(routes, index, [0], 4)
    with pytest.raises(ValueError, match="MoE layer 4"):
        routes_for_router(routes, index, [4], K)
    with pytest.raises(ValueError, match="unevenly"):
        sequence_shard(torch.arange(5), 0, 2)
    with pytest.raises(RuntimeError, match="MoE layers \\[1\\]"):
        routes_to_batch({0: torch.zeros(8, K, dtype=torch.long)}, index, mask, 2)
