"""GRPO end to end on tiny non-Qwen3.5 causal LMs (Qwen2.5 with q/k/v biases, Llama, Qwen3) built here.

hf engine: default suite. vLLM's CPU build: tests/workers/rollout/test_vllm_grpo_e2e.py (-m vllm).
"""

from __future__ import annotations

import math

import pytest

from tests.trainer.e2e_utils import run_main_ppo, train_records


def generic_grpo_overrides(model_path, steps: int = 2) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model_path}", f"trainer.total_training_steps={steps}",
        "trainer.launcher=local", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
    ]


@pytest.mark.parametrize("kind", ["qwen2_5", "llama", "qwen3"])
def test_grpo_step_hf_engine(tmp_path, kind):
    from tests.generic_models import build_generic_lm

    model = tmp_path / "model"
    build_generic_lm(model, kind, tie=kind != "llama")
    # One step keeps the default suite fast: rollout, log-probs, reference and actor update all run once.
    _, rec = run_main_ppo(tmp_path / "run", ["actor_rollout_ref.rollout.name=hf",
                                             *generic_grpo_overrides(model, steps=1)])
    steps = train_records(rec)
    assert sorted(steps) == [1]
    for s in steps.values():
        assert math.isfinite(s["actor/pg_loss"]) and s["response_length/mean"] > 0
