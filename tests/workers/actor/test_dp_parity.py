"""Two FSDP2 ranks on gloo give the same loss and gradients as one rank on the same batch (actor role on the
FSDP engine)."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(n=8, prompt=6, response=5, vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(20, vocab, (n, prompt + response), generator=g)
    attention_mask = torch.ones(n, prompt + response, dtype=torch.long)
    for i in range(n):  # ragged: left-padded prompts, right-padded responses
        attention_mask[i, : i % 3] = 0
        attention_mask[i, prompt + response - (i % 4) :] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, prompt:].clone()
    return {
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "responses": input_ids[:, prompt:], "response_mask": response_mask,
        "old_log_probs": -torch.rand(n, response, generator=g) * 3,
        "advantages": torch.randn(n, response, generator=g),
    }


def _worker(rank, world, port, model_dir, loss_agg_mode, use_remove_padding, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist
    from omegaconf import open_dict

    from tests.engine_utils import arr_config, leave_process_group, make_engine, sgd
    from verl.protocol import DataProto
    from verl.workers.actor.ppo_actor import PPOActor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = arr_config(model_dir, [f"actor_rollout_ref.model.use_remove_padding={use_remove_padding}"])
    with open_dict(cfg):
        cfg.actor.ppo_mini_batch_size = 8 // world
        cfg.actor.ppo_micro_batch_size_per_gpu = 1 if world == 1 else 2  # different splits on purpose
        cfg.actor.loss_agg_mode = loss_agg_mode
        cfg.actor.entropy_coeff = 0.01
    engine = make_engine(sgd(cfg.actor), cfg.model, "actor")
    assert engine.use_remove_padding == use_remove_padding
    actor = PPOActor(cfg.actor, engine)
    model = engine.module
    full = make_batch()
    data = DataProto.from_dict(tensors=full, meta_info={"temperature": 0.9}).chunk(world)[rank]
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    metrics = actor.update_policy(data)
    after = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    delta = {k: (before[k] - after[k]).numpy() for k in before}  # = lr * grad with SGD; numpy: no fd sharing
    if rank == 0:
        out_q.put((metrics, delta))
    else:
        out_q.put((metrics, None))
    leave_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("dp_parity_model")
    build_tiny_qwen3_5(str(path), kind="dense", seed=0)
    return str(path)


def _run(world, mode, rmpad, model_dir):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, model_dir, mode, rmpad, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    metrics = [m for m, _ in results]
    delta = next(d for _, d in results if d is not None)
    return metrics, delta


@pytest.mark.parametrize("mode,rmpad", [("token-mean", True), ("seq-mean-token-mean", False)])
def test_two_ranks_match_one_rank(mode, rmpad, model_dir):
    m1, d1 = _run(1, mode, rmpad, model_dir)
    m2, d2 = _run(2, mode, rmpad, model_dir)
    # Loss metrics are each rank's share of the global mini-batch loss; averaged over ranks they must agree.
    loss1 = m1[0]["actor/pg_loss"][0]
    loss2 = sum(m["actor/pg_loss"][0] for m in m2) / 2
    assert loss1 == pytest.approx(loss2, rel=1e-4, abs=1e-6)
    assert m1[0]["actor/grad_norm"][0] == pytest.approx(m2[0]["actor/grad_norm"][0], rel=1e-4)
    assert any(abs(v).max() > 0 for v in d1.values())
    for k in d1:
        torch.testing.assert_close(torch.from_numpy(d1[k]), torch.from_numpy(d2[k]), rtol=1e-4, atol=1e-6)
