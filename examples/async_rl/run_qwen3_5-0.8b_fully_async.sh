#!/usr/bin/env bash
# Fully asynchronous GRPO on two GPUs: the rollout GPU (built-in `hf` engine) generates continuously into a
# queue, 8 prompts per call; the trainer GPU (FSDP2) takes 2 x 32 prompts per step and sends its weights every
# 2 steps; generation may run 50% ahead of what the trainer consumes between two syncs
# (async_training.staleness_threshold). 64 prompts per rollout GPU are in generation at once
# (async_training.concurrent_samples_per_replica): 8 chunks in flight share the engine's decode slots, so the
# slots a chunk's short responses free are taken by the next chunks while its long tail decodes.
# At a weight sync the chunks in flight finish with the old weights first (the drain). PARTIAL_ROLLOUT=True
# (async_training.partial_rollout, upstream's default) pauses them between two decode steps instead, installs the
# new weights and continues the unfinished responses with them (their prefixes re-prefilled; every token records
# the version it was sampled with). It is off here until a GPU run has checked it.
# ROLLOUT_NAME=vllm makes vLLM the rollout GPU's engine (the `vllm` extra; its engine keeps the chunks in flight
# with its own continuous batching, and partial rollout resubmits the unfinished responses after a sync).
# See docs/advance/async_rl.md.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-0.8B (no hub is contacted), e.g. MODEL_PATH=$HOME/models/Qwen3.5-0.8B
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-0.8B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

"$PYTHON" -m verl.experimental.fully_async_policy.fully_async_main \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=0 \
    data.gen_batch_size=8 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name="${ROLLOUT_NAME:-hf}" \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    async_training.staleness_threshold=0.5 \
    async_training.trigger_parameter_sync_step=2 \
    async_training.require_batches=2 \
    async_training.partial_rollout="${PARTIAL_ROLLOUT:-False}" \
    async_training.concurrent_samples_per_replica=64 \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    rollout.n_gpus_per_node=1 \
    rollout.nnodes=1 \
    rollout.total_rollout_steps=6400 \
    trainer.total_epochs=1 "$@"
