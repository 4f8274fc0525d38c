"""Ulysses sequence parallelism on the reference policy: ``actor_rollout_ref.ref.ulysses_sequence_parallel_size``
(and upstream's newer home ``actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size``) set apart from
the actor's.

Two gloo ranks run the real worker (role ``ref``) with the actor at SP 1, so the controller dispatches each rank
its own chunk, and the reference at SP 2, so both ranks must run one batch split over them: the worker regroups
the chunks, and each rank must hand back exactly the reference log-probs of its own chunk, as one process
without sequence parallelism computes them."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

R = "actor_rollout_ref.ref"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(model_dir, world, *overrides):
    from verl.trainer.config.checks import compose_config

    return compose_config("ppo_trainer", [
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false", "actor_rollout_ref.actor.use_kl_loss=true",
        f"trainer.n_gpus_per_node={world}", f"{R}.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", *overrides])


def _batch(n=8, prompt=5, response=4):
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(20, 100, (n, prompt + response), generator=g)
    mask = torch.ones(n, prompt + response, dtype=torch.long)
    for i in range(n):  # left-padded prompts, right-padded responses
        mask[i, : i % 3] = 0
        mask[i, prompt + response - (i % 4):] = 0
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:],
                                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                                        "response_mask": mask[:, prompt:].clone()})


def _ref_worker(model_dir, world, overrides):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cfg = _config(model_dir, world, *overrides)
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="ref", full_config=cfg)
    worker.init_model()
    return worker


def _rank(rank, world, port, model_dir, overrides, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from tests.engine_utils import leave_process_group

    worker = _ref_worker(model_dir, world, overrides)
    from verl.single_controller.dp_layout import DataParallelLayout

    # the reference's SP group, while the data arrives in the actor's layout (one replica per rank)
    assert worker.ref_engine.sp_size == 2 and worker._dp_layout == DataParallelLayout.blocks(world)
    chunk = _batch().chunk(world)[rank]  # what DP dispatch gives this rank (the actor's dp size is 2)
    out = worker.compute_ref_log_prob(chunk)
    out_q.put((rank, out.batch["ref_log_prob"].tolist()))  # plain data: the process leaves before it is read
    leave_process_group()


@pytest.mark.slow  # two spawned ranks plus one: minutes on 2 shared cores
def test_reference_runs_its_own_sequence_parallel_size(tmp_path):
    overrides = [f"{R}.fsdp_config.ulysses_sequence_parallel_size=2"]  # upstream's newer home
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    model_dir = str(tmp_path / "m")
    build_tiny_qwen3_5(model_dir, kind="dense", seed=0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, model_dir, overrides, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    # one process, no sequence parallelism, the whole batch
    from tests.engine_utils import single_rank_gloo

    with single_rank_gloo():
        os.environ.update(RANK="0", WORLD_SIZE="1")
        expected = _ref_worker(model_dir, 1, []).compute_ref_log_prob(_batch()).batch["ref_log_prob"]
    torch.testing.assert_close(torch.tensor(got[0] + got[1]), expected, rtol=1e-4, atol=1e-5)


def test_fsdp_config_home_sets_the_reference_size_only():
    cfg = _config("/m", 2, f"{R}.fsdp_config.ulysses_sequence_parallel_size=2")
    assert cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 1
    cfg = _config("/m", 2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    assert cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2  # follows the actor's unless set


def test_ref_sequence_parallel_is_validated(tmp_path):
    from verl.trainer.config import ConfigValidationError

    with pytest.raises(ConfigValidationError, match=f"{R}.ulysses_sequence_parallel_size"):
        _config("/m", 2, f"{R}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false")
    with pytest.raises(ConfigValidationError, match=f"{R}.ulysses_sequence_parallel_size.*LoRA"):
        _config("/m", 2, f"{R}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.lora_rank=4")
