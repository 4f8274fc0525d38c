"""Helpers for tests that build training engines (imported as ``tests.engine_utils``)."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist
from omegaconf import open_dict


@contextmanager
def single_rank_gloo():
    """World size 1 over a file:// rendezvous (no ports); reuses an existing group."""
    if dist.is_initialized():
        yield
        return
    fd, path = tempfile.mkstemp(prefix="verl_engine_pg_")
    os.close(fd)
    os.remove(path)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def leave_process_group():
    """Every rank meets at a barrier, then tears its group down. Without the barrier a rank that finishes
    first closes its gloo pairs while a peer is still receiving the tail of the last collective, and that
    peer aborts at exit ("terminate called without an active exception", SIGABRT)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextmanager
def rank_report(result_dir: str, rank: int):
    """Inside a rank started by :func:`spawn_ranks`: the body's exception (spawn hides a child's traceback from
    pytest) goes to the rank's status file, and the rank leaves its process group either way."""
    status = "ok"
    try:
        yield
    except Exception as exc:
        import traceback

        status = f"{exc!r}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(status)
        leave_process_group()


def spawn_ranks(worker, nprocs: int, result_dir: str, *args) -> None:
    """``worker(rank, init_file, result_dir, *args)`` on ``nprocs`` processes (a ``file://`` rendezvous in
    ``result_dir``); fails with the first rank's traceback that :func:`rank_report` recorded."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(os.path.join(result_dir, "init"), result_dir, *args), nprocs=nprocs, join=True)
    for rank in range(nprocs):
        with open(os.path.join(result_dir, f"rank{rank}")) as f:
            status = f.read()
        assert status == "ok", f"rank {rank}: {status}"


def arr_config(model_dir: str, overrides=(), **actor_keys):
    """The composed ``actor_rollout_ref`` section for a tiny checkpoint (no gradient checkpointing), with
    ``actor_keys`` set on the actor section."""
    from verl.trainer.config.checks import compose_config

    cfg = compose_config("ppo_trainer", ["actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
                                         "actor_rollout_ref.model.enable_gradient_checkpointing=false", *overrides],
                         validate=False).actor_rollout_ref
    with open_dict(cfg):
        for k, v in actor_keys.items():
            cfg.actor[k] = v
    return cfg


def make_engine(role_cfg, model_cfg, role: str = "actor", **kwargs):
    from verl.workers.engine_workers import build_engine

    engine = build_engine(role_cfg, model_cfg, role, trainable=role != "ref", **kwargs)
    engine.initialize()
    return engine


def sgd(role_cfg, lr: float = 1.0):
    """Plain SGD (the update is lr * grad, so parameter deltas compare gradients)."""
    with open_dict(role_cfg):
        role_cfg.optim.optimizer = "SGD"
        role_cfg.optim.lr = lr
        role_cfg.optim.weight_decay = 0.0
    return role_cfg


def ragged_batch(n=6, prompt=5, response=4, vocab=100, seed=0):
    """A batch of left-padded prompts and right-padded responses of varied lengths, with old log-probs and
    advantages: the layout the trainer hands an engine."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, vocab, (n, prompt + response), generator=g)
    mask = torch.ones(n, prompt + response, dtype=torch.long)
    for i in range(n):  # left-padded prompts, right-padded responses
        mask[i, : i % 3] = 0
        mask[i, prompt + response - (i % 4):] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:].clone(),
            "old_log_probs": -torch.rand(n, response, generator=g) * 3,
            "advantages": torch.randn(n, response, generator=g)}
