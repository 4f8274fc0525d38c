#!/usr/bin/env bash
# GRPO on Qwen3.5-35B-A3B (MoE) with router replay R3: the built-in `hf` rollout engine records the experts it
# routed every prompt and response token to (rollout.enable_rollout_routing_replay=true, returned as
# routed_experts) and every actor forward -- old log-probs and the update -- replays them
# (actor.fsdp_config.router_replay.mode=R3), so the trainer's log-probs differ from the rollout's only by
# numerics, not by a different choice of experts. See docs/advance/router_replay.md.
# R2 instead (router_replay.mode=R2, enable_rollout_routing_replay left false): the old-log-prob pass records
# the actor's own routes and the update replays those.
# Not run at this size here (what was measured: docs/advance/router_replay.md); the tiny-model CPU check is
# tests/trainer/test_router_replay_e2e.py.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-35B-A3B, e.g. MODEL_PATH=$HOME/models/Qwen3.5-35B-A3B
set -xeuo pipefail

PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-35B-A3B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

"$PYTHON" -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
    actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 "$@"
