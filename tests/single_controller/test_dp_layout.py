"""Data-parallel layouts: which replica each rank serves, and dispatch / collection through a worker group that
follows a layout whose replicas are not blocks of consecutive ranks (Megatron, pipeline outermost)."""

from __future__ import annotations

import itertools

import pytest
import torch

from verl.protocol import DataProto
from verl.single_controller.decorator import Dispatch, register
from verl.single_controller.dp_layout import DataParallelLayout
from verl.single_controller.worker_group import WorkerGroup
from verl.workers.engine.megatron.layout import RANK_ORDER, megatron_dp_layout
from verl.workers.engine.sections import role_dp_layout


def _enumerate(world, tp, cp, pp):
    """Brute force over every (tp_r, cp_r, dp_r, pp_r): rank = tp_r + tp*(cp_r + cp*(dp_r + dp*pp_r))."""
    dp = world // (tp * cp * pp)
    replica, stage = {}, {}
    for tp_r, cp_r, dp_r, pp_r in itertools.product(range(tp), range(cp), range(dp), range(pp)):
        rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))
        assert rank not in replica
        replica[rank], stage[rank] = dp_r, pp_r
    assert sorted(replica) == list(range(world))
    return [replica[r] for r in range(world)], [stage[r] for r in range(world)], dp


LAYOUTS = [(16, 2, 1, 2), (8, 4, 1, 2), (8, 1, 1, 2), (12, 2, 1, 3), (16, 2, 2, 2), (4, 1, 1, 4), (8, 2, 1, 1)]


@pytest.mark.parametrize("world, tp, cp, pp", LAYOUTS)
def test_megatron_layout_matches_the_rank_formula(world, tp, cp, pp):
    layout = megatron_dp_layout(world, tp=tp, cp=cp, pp=pp)
    replica, stage, dp = _enumerate(world, tp, cp, pp)
    assert list(layout.replica_of) == replica and layout.dp_size == dp
    for d, r in enumerate(layout.collect_from):
        assert replica[r] == d and stage[r] == pp - 1  # collected on the last pipeline stage, where outputs form
    assert layout.ranks_per_replica == tp * cp * pp


@pytest.mark.parametrize("world, tp, pp, ep, etp", [(16, 2, 2, 8, 1), (8, 4, 2, 2, 1), (16, 4, 2, 2, None), (4, 1, 2, 2, 1)])
def test_dense_and_expert_pipeline_stages_coincide(world, tp, pp, ep, etp):
    """Why pp goes outermost: under tp-cp-ep-dp-pp the expert layers' decomposition (etp, ep, expert-dp, pp)
    gives every rank the same pipeline stage as the dense one, for any EP * ETP (megatron-core requires that)."""
    assert RANK_ORDER == "tp-cp-ep-dp-pp"
    etp = etp or tp
    _, dense_stage, _ = _enumerate(world, tp, 1, pp)
    edp = world // (etp * ep * pp)
    expert_stage = {}
    for etp_r, ep_r, edp_r, pp_r in itertools.product(range(etp), range(ep), range(edp), range(pp)):
        expert_stage[etp_r + etp * (ep_r + ep * (edp_r + edp * pp_r))] = pp_r
    assert [expert_stage[r] for r in range(world)] == dense_stage


def test_upstream_35b_layout_spreads_a_replica_over_the_stages():
    layout = megatron_dp_layout(16, tp=2, pp=2)  # EP 8, ETP 1 do not change the dense replicas
    assert layout.dp_size == 4
    assert [r for r in range(16) if layout.replica_of[r] == 1] == [2, 3, 10, 11]
    assert layout.collect_from == (8, 10, 12, 14)


def test_role_layouts_follow_the_engine():
    meg = {"strategy": "megatron", "megatron": {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2,
                                                "context_parallel_size": 1, "expert_model_parallel_size": 2}}
    assert role_dp_layout(meg, 8) == megatron_dp_layout(8, tp=4, pp=2)
    assert role_dp_layout(meg, 8).replica_of == (0, 0, 0, 0, 0, 0, 0, 0)
    fsdp = {"strategy": "fsdp2", "ulysses_sequence_parallel_size": 2}
    assert role_dp_layout(fsdp, 8) == DataParallelLayout.blocks(8, 4)
    assert DataParallelLayout.blocks(8, 4).replica_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert DataParallelLayout.blocks(8, 4).collect_from == (0, 2, 4, 6)
    assert role_dp_layout({"strategy": "fsdp2"}, 3) == DataParallelLayout.blocks(3)
    with pytest.raises(ValueError, match="must divide the world size"):
        role_dp_layout({"strategy": "fsdp2", "ulysses_sequence_parallel_size": 3}, 8)
    with pytest.raises(ValueError, match="must divide the world size"):
        megatron_dp_layout(8, tp=3)


def test_layout_rejects_tables_that_are_not_layouts():
    with pytest.raises(ValueError, match="same number of ranks"):
        DataParallelLayout((0, 0, 1), (0, 2))
    with pytest.raises(ValueError, match="not one of its ranks"):
        DataParallelLayout((0, 1, 0, 1), (0, 0))
    with pytest.raises(ValueError, match="same number of ranks"):
        DataParallelLayout((0, 2, 0, 2), (0, 1))


class _RankEcho:
    def __init__(self, rank):
        self.rank = rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute(self, data):
        x = data.batch["x"]
        return DataProto.from_dict(tensors={"x": x, "rank": torch.full_like(x, self.rank)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update(self, data):
        return {"rank": self.rank, "rows": data.batch["x"].tolist()}


class _FakeRanks(WorkerGroup):
    """One fake worker per rank, each knowing its rank; records what every rank received."""

    def __init__(self, layout):
        self.workers = [_RankEcho(r) for r in range(layout.world_size)]
        self.received = {}
        super().__init__(_RankEcho, layout.world_size, role="actor", layout=layout)

    def _call_ranks(self, method, per_rank, ranks):
        outs = []
        for r, (a, kw) in zip(ranks, per_rank):
            self.received[r] = a[0].batch["x"].tolist()
            outs.append(getattr(self.workers[r], method)(*a, **kw))
        return outs


def test_worker_group_dispatches_and_collects_by_a_non_block_layout():
    layout = megatron_dp_layout(8, tp=2, pp=2)  # replicas: {0,1,4,5} and {2,3,6,7}
    wg = _FakeRanks(layout)
    assert wg.dp_size == 2
    out = wg.compute(DataProto.from_dict(tensors={"x": torch.arange(6)}))
    assert {r: rows for r, rows in wg.received.items()} == {
        0: [0, 1, 2], 1: [0, 1, 2], 4: [0, 1, 2], 5: [0, 1, 2], 2: [3, 4, 5], 3: [3, 4, 5], 6: [3, 4, 5], 7: [3, 4, 5]}
    assert out.batch["x"].tolist() == list(range(6))  # rows back in the order they were sent
    assert out.batch["rank"].tolist() == [4, 4, 4, 6, 6, 6]  # one last-stage rank per replica
    metrics = wg.update(DataProto.from_dict(tensors={"x": torch.arange(4)}))
    assert metrics == [{"rank": 4, "rows": [0, 1]}, {"rank": 6, "rows": [2, 3]}]
    # the trainer pads to the number of replicas, not the world size
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.world_size = 8
    assert trainer._dp_size(wg.compute) == 2
    assert trainer._dp_call(wg.compute, DataProto.from_dict(tensors={"x": torch.arange(3)})).batch["x"].tolist() \
        == [0, 1, 2]


def test_worker_group_rejects_a_layout_of_another_size():
    with pytest.raises(ValueError, match="covers 4 ranks"):
        WorkerGroup.__init__(_FakeRanks.__new__(_FakeRanks), _RankEcho, 8, layout=DataParallelLayout.blocks(4))
