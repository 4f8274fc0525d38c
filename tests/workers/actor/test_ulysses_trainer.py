"""Ulysses SP wired into the trainer: dispatch by data-parallel group, and an SP=2 actor update == SP=1.

The parity check reuses test_dp_parity's structure: SGD with lr=1, so the parameter change is the gradient.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from verl.protocol import DataProto
from verl.single_controller.decorator import Dispatch, register
from verl.single_controller.dp_layout import DataParallelLayout
from verl.single_controller.worker_group import WorkerGroup, collect_results, dispatch_args

from test_dp_parity import make_batch


# ------------------------------------------------------------------ dispatch (pure Python)
class _EchoWorker:
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute(self, data):
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update(self, data):
        return {"rows": data.batch["x"].tolist()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self):
        return True


class _FakeGroup(WorkerGroup):
    def __init__(self, world_size, dp_size=None):
        self.calls = []
        super().__init__(_EchoWorker, world_size, role="actor",
                         layout=DataParallelLayout.blocks(world_size, dp_size))

    def _call_ranks(self, method, per_rank, ranks):
        self.calls.append((method, ranks, per_rank))
        worker = _EchoWorker()
        return [getattr(worker, method)(*a, **kw) for a, kw in per_rank]


def _rows(n):
    return DataProto.from_dict(tensors={"x": torch.arange(n)})


def test_dispatch_sends_one_chunk_per_sp_group_and_collects_once():
    wg = _FakeGroup(world_size=4, dp_size=2)  # ranks (0, 1) and (2, 3) form SP groups
    out = wg.compute(_rows(8))
    _, ranks, per_rank = wg.calls[-1]
    assert ranks == [0, 1, 2, 3]
    chunks = [a[0].batch["x"].tolist() for a, _ in per_rank]
    assert chunks == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert out.batch["x"].tolist() == list(range(8))  # one copy per DP group, in order
    metrics = wg.update(_rows(8))
    assert metrics == [{"rows": [0, 1, 2, 3]}, {"rows": [4, 5, 6, 7]}]
    assert wg.ping() == [True] * 4  # non-DP modes still reach and return every rank
    assert wg.update.worker_group is wg and wg.dp_size == 2


def test_dispatch_default_is_one_chunk_per_rank():
    wg = _FakeGroup(world_size=2)
    assert wg.dp_size == 2
    out = wg.compute(_rows(4))
    assert [a[0].batch["x"].tolist() for a, _ in wg.calls[-1][2]] == [[0, 1], [2, 3]]
    assert out.batch["x"].tolist() == [0, 1, 2, 3]
    # the module-level helpers default to one replica per rank
    per_rank = dispatch_args(Dispatch.DP_COMPUTE_METRIC, 2, (_rows(4),), {})
    assert [a[0].batch["x"].tolist() for a, _ in per_rank] == [[0, 1], [2, 3]]
    assert collect_results(Dispatch.DP_COMPUTE_METRIC, ["a", "b"]) == ["a", "b"]


def test_dispatch_rejects_bad_layout():
    with pytest.raises(ValueError):
        _FakeGroup(world_size=4, dp_size=3)
    with pytest.raises(ValueError):  # 6 rows cannot split over 4 DP groups
        _FakeGroup(world_size=4, dp_size=4).compute(_rows(6))


def test_trainer_pads_to_dp_size():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    wg = _FakeGroup(world_size=4, dp_size=2)
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.world_size = 4
    assert trainer._dp_size(wg.compute) == 2
    out = trainer._dp_call(wg.compute, _rows(6))  # 6 % 2 == 0: no padding needed, 6 % 4 != 0 would have padded
    assert wg.calls[-1][2][0][0][0].batch["x"].tolist() == [0, 1, 2]
    assert out.batch["x"].tolist() == list(range(6))
    assert len(trainer._metric_call(wg.update, _rows(6))) == 2


# ------------------------------------------------------------------ SP=2 actor update == SP=1
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, sp, port, model_dir, loss_agg_mode, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist
    from omegaconf import open_dict

    from tests.engine_utils import arr_config, leave_process_group, make_engine, sgd
    from verl.utils import ulysses
    from verl.workers.actor.ppo_actor import PPOActor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dp = world // sp
    cfg = arr_config(model_dir, [f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"])
    with open_dict(cfg):
        cfg.actor.ppo_mini_batch_size = 8 // dp
        cfg.actor.ppo_micro_batch_size_per_gpu = 1 if world == 1 else 2  # different splits on purpose
        cfg.actor.loss_agg_mode = loss_agg_mode
        cfg.actor.entropy_coeff = 0.01
        cfg.actor.use_kl_loss = True
        cfg.actor.kl_loss_coef = 0.1
    engine = make_engine(sgd(cfg.actor), cfg.model, "actor")  # FSDP over all ranks, (dp, sp) mesh for SP
    assert engine.dp_size == dp and engine.dp_rank == rank // sp
    actor = PPOActor(cfg.actor, engine)
    model = engine.module
    full = make_batch()
    full["ref_log_prob"] = full["old_log_probs"] * 0.9
    data = DataProto.from_dict(tensors=full, meta_info={"temperature": 0.9}).chunk(dp)[rank // sp]
    log_probs, _ = actor.compute_log_prob(DataProto.from_dict(
        tensors={k: v.clone() for k, v in data.batch.items()},
        meta_info={"temperature": 0.9, "micro_batch_size": 3}))
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    metrics = actor.update_policy(data)
    after = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    delta = {k: (before[k] - after[k]).numpy() for k in before}  # = lr * grad with SGD; numpy: no fd sharing
    out_q.put((rank, metrics, log_probs.numpy(), delta if rank == 0 else None))
    assert ulysses.get_ulysses_sequence_parallel_group() is None  # set only around the engine's forwards
    leave_process_group()


_MODEL_DIR = {}


def _model_dir():
    """One tiny checkpoint per test session (the workers load it through the engine)."""
    if "path" not in _MODEL_DIR:
        import tempfile

        from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

        path = tempfile.mkdtemp(prefix="verl_ulysses_model_")
        build_tiny_qwen3_5(path, kind="dense", seed=0, with_tokenizer=False)
        _MODEL_DIR["path"] = path
    return _MODEL_DIR["path"]


def _run(world, sp, mode):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, sp, port, _model_dir(), mode, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return [r[1] for r in results], [r[2] for r in results], results[0][3]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_sp2_update_matches_sp1(mode):
    m1, lp1, d1 = _run(1, 1, mode)
    m2, lp2, d2 = _run(2, 2, mode)
    # Both ranks of the SP group compute the whole (single DP group's) loss on the same rows.
    _check_match(m1, lp1, d1, m2, lp2, d2)


@pytest.mark.slow
def test_dp2_sp2_update_matches_sp1():
    """World 4 = 2 DP groups x SP 2: global token counts must count each DP group's rows once."""
    m1, lp1, d1 = _run(1, 1, "token-mean")
    m4, lp4, d4 = _run(4, 2, "token-mean")
    # Loss metrics are each DP group's share of the global mini-batch loss (as in test_dp_parity).
    loss = (m4[0]["actor/pg_loss"][0] + m4[2]["actor/pg_loss"][0]) / 2
    assert loss == pytest.approx(m1[0]["actor/pg_loss"][0], rel=1e-4, abs=1e-6)
    assert m4[1]["actor/pg_loss"] == m4[0]["actor/pg_loss"] and m4[3]["actor/pg_loss"] == m4[2]["actor/pg_loss"]
    assert m4[0]["actor/grad_norm"][0] == pytest.approx(m1[0]["actor/grad_norm"][0], rel=1e-4)
    # Compared on real response tokens: a masked position's value depends on what follows in the packed row.
    mask = make_batch()["response_mask"].bool()
    torch.testing.assert_close(torch.from_numpy(lp4[0])[mask[:4]], torch.from_numpy(lp1[0])[:4][mask[:4]],
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(lp4[2])[mask[4:]], torch.from_numpy(lp1[0])[4:][mask[4:]],
                               rtol=1e-4, atol=1e-5)
    for k in d1:
        torch.testing.assert_close(torch.from_numpy(d1[k]), torch.from_numpy(d4[k]), rtol=1e-4, atol=1e-6,
                                   msg=lambda s, k=k: f"{k}: {s}")


def _check_match(m1, lp1, d1, m2, lp2, d2):
    for m in m2:
        assert m["actor/pg_loss"][0] == pytest.approx(m1[0]["actor/pg_loss"][0], rel=1e-4, abs=1e-6)
        assert m["actor/kl_loss"][0] == pytest.approx(m1[0]["actor/kl_loss"][0], rel=1e-4, abs=1e-6)
        assert m["actor/grad_norm"][0] == pytest.approx(m1[0]["actor/grad_norm"][0], rel=1e-4)
    mask = make_batch()["response_mask"].bool()
    for lp in lp2:
        torch.testing.assert_close(torch.from_numpy(lp)[mask], torch.from_numpy(lp1[0])[mask], rtol=1e-4, atol=1e-5)
    assert any(abs(v).max() > 0 for v in d1.values())
    for k in d1:
        torch.testing.assert_close(torch.from_numpy(d1[k]), torch.from_numpy(d2[k]), rtol=1e-4, atol=1e-6,
                                   msg=lambda s, k=k: f"{k}: {s}")
