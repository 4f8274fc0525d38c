"""Which engines hand the hf rollout's weights back between generations (``rollout.free_cache_engine``).

The worker binds the weight cycle's ``release`` to the actor engine's ``release_hf_rollout_module``: on FSDP2 the
hf rollout generates with the training module itself, so releasing frees nothing and the weights stay in
sync; with ``free_cache_engine=false`` nothing is released at all. (The Megatron engine's release of its Hugging
Face copy is checked in tests/workers/engine/test_megatron_hf_copy_release.py and, on a GPU, in
test_megatron_qwen35_gpu.py.) One real worker per case, on the CPU."""

from __future__ import annotations

import pytest


def _worker(model_dir, *overrides):
    from verl.trainer.config.checks import compose_config
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cfg = compose_config("ppo_trainer", [
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.model.path={model_dir}",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2", *overrides])
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout", full_config=cfg)
    worker.init_model()
    return worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5

    path = tmp_path_factory.mktemp("qwen35")
    build_tiny_qwen3_5(path, kind="dense", seed=1)
    return str(path)


@pytest.mark.parametrize("free", [True, False])
def test_hf_rollout_on_fsdp_keeps_the_training_module(model_dir, free):
    import torch.distributed as dist

    from tests.engine_utils import leave_process_group

    had_group = dist.is_initialized()  # another test's session-wide group: the worker joins it, leaves it be
    worker = _worker(model_dir, f"actor_rollout_ref.rollout.free_cache_engine={str(free).lower()}")
    try:
        cycle = worker.rollout_cycle
        if not free:
            assert cycle.release is None
            return
        assert cycle.release == worker.actor_engine.release_hf_rollout_module
        cycle.before_generate()
        cycle.after_generate()
        assert cycle.stale is False  # nothing was freed: no sync owed before the next generation
        assert all(p.numel() == 0 or p.untyped_storage().nbytes() for p in worker.actor_engine.module.parameters())
    finally:
        if not had_group:
            leave_process_group()
