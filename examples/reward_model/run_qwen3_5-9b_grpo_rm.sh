#!/usr/bin/env bash
# GRPO where a discriminative reward model scores the responses (reward.reward_model.*), colocated with the
# policy on the same GPUs. The reward model is any *ForSequenceClassification checkpoint with one output (e.g. a
# Qwen3.5 backbone with a score head); its own tokenizer and chat template render prompt + response, and its
# score is the reward (no rule reward is added, as upstream). See docs/advance/reward_model.md.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Models: local copies, e.g. MODEL_PATH=$HOME/models/Qwen3.5-9B RM_PATH=$HOME/models/my-qwen3_5-rm
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-9B}
RM_PATH=${RM_PATH:-$HOME/models/my-qwen3_5-rm}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

"$PYTHON" -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    reward.reward_model.enable=True \
    reward.reward_model.model_path="$RM_PATH" \
    reward.reward_model.rollout.name=vllm \
    reward.reward_model.rollout.dtype=bfloat16 \
    reward.reward_model.rollout.max_num_batched_tokens=16384 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 "$@"
