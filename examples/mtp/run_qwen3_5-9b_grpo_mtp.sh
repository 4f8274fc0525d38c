#!/usr/bin/env bash
# GRPO on GSM8K with Qwen3.5-9B, FSDP2 actor, keeping and training the checkpoint's MTP head (NOT RUN here:
# written for one node of 8 GPUs; the CPU path is covered by tests and run_qwen3_5_tiny_sft_mtp_cpu.sh).
# The actor loss gets mtp_loss_scaling_factor * (MTP cross-entropy on the response tokens), logged as
# actor/mtp_losses/mtp_1_loss; checkpoints and HF exports keep `mtp.*`; the vLLM rollout gets the weights
# without the head (speculative decoding with it, model.mtp.enable_rollout, is built into the hf rollout only:
# run_qwen3_5-0.8b_grpo_mtp_spec.sh).
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
set -xeuo pipefail

PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-9B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}

"$PYTHON" -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.model.mtp.enable=True \
    actor_rollout_ref.model.mtp.enable_train=True \
    actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.1 \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.project_name=gsm8k-grpo \
    trainer.experiment_name=qwen3_5-9b-mtp \
    trainer.logger='["console"]' \
    trainer.total_epochs=1 "$@"
