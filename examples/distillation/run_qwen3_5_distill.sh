#!/usr/bin/env bash
# GRPO + on-policy distillation: Qwen3.5-0.8B (student) trained on GSM8K with its task reward plus the reverse KL
# to Qwen3.5-9B (teacher) on its own samples (k3 estimator, back-propagated), FSDP2, colocated vLLM rollout,
# 8 GPUs. The teacher is colocated with the actor and runs on the reference's engine settings
# (actor_rollout_ref.ref.*: here its parameters are offloaded between uses). See docs/advance/distillation.md.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Models: local copies (no hub is contacted) sharing one tokenizer, e.g. MODEL_PATH=$HOME/models/Qwen3.5-0.8B
# TEACHER_PATH=$HOME/models/Qwen3.5-9B
# Not run by this project yet (no GPU run of distillation so far); the CPU test is
# tests/trainer/test_distillation_e2e.py.
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-0.8B}
TEACHER_PATH=${TEACHER_PATH:-$HOME/models/Qwen3.5-9B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
NGPUS=${NGPUS:-8}

"$PYTHON" -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    distillation.enabled=True \
    distillation.teacher_models.teacher_model.model_path="$TEACHER_PATH" \
    distillation.distillation_loss.loss_mode=k3 \
    distillation.distillation_loss.use_task_rewards=True \
    distillation.distillation_loss.distillation_loss_coef=1.0 \
    distillation.distillation_loss.use_policy_gradient=False \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name=verl_distill_qwen3_5 \
    trainer.experiment_name=qwen3_5_0.8b_from_9b \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 "$@"
