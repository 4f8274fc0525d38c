#!/usr/bin/env bash
# One-step off-policy GRPO on two GPUs: one trains (FSDP2), one generates (the built-in `hf` engine). Generation
# of step k+1 overlaps the training of step k; weights go to the rollout GPU after every step, so each batch
# is one weight version old and the loss measures its ratio against the policy that generated it
# (algorithm.rollout_correction.bypass_mode=true, the mode's default). See docs/advance/async_rl.md.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-0.8B (no hub is contacted), e.g. MODEL_PATH=$HOME/models/Qwen3.5-0.8B
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-0.8B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

"$PYTHON" -m verl.experimental.one_step_off_policy.main_ppo \
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
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    rollout.n_gpus_per_node=1 \
    rollout.nnodes=1 \
    trainer.total_epochs=1 "$@"
