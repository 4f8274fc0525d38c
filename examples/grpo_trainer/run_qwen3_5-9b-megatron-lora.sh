#!/usr/bin/env bash
# GRPO with LoRA on Qwen3.5-9B (dense) with the Megatron-Core engine, one node of 8 GPUs (TP 2), vLLM rollout.
# The adapters sit on megatron-core's tensor-parallel linears (docs/advance/megatron.md, "LoRA"): rank 32 on every
# linear of the attention, Gated DeltaNet and MLP blocks (upstream's model.lora.* keys; target names are
# megatron-core's: linear_qkv, linear_proj, in_proj, out_proj, linear_fc1, linear_fc2, or all-linear). Only the
# adapters train; the reference policy is the actor with its adapters off (no second copy of the base); vLLM gets
# merged weights after each update (lora.merge is true on this engine).
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-9B (no hub is contacted), e.g. MODEL_PATH=$HOME/models/Qwen3.5-9B
# Needs the mcore extra (.venv/bin/pip install -e ".[mcore]": megatron-core >= 0.18, Python 3.12, CUDA).
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-9B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
NGPUS=${NGPUS:-8}
MEGA=actor_rollout_ref.actor.megatron

"$PYTHON" -m verl.trainer.main_ppo --config-name ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=128 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.lora.rank=32 \
    actor_rollout_ref.model.lora.alpha=64 \
    actor_rollout_ref.model.lora.target_modules=all-linear \
    actor_rollout_ref.model.lora.lora_A_init_method=xavier \
    actor_rollout_ref.actor.optim.lr=3e-5 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    $MEGA.tensor_model_parallel_size=2 \
    $MEGA.use_remove_padding=True \
    $MEGA.param_offload=True \
    $MEGA.grad_offload=True \
    $MEGA.optimizer_offload=True \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name=verl_grpo_example_gsm8k \
    trainer.experiment_name=qwen3_5_9b_megatron_lora \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 "$@"
