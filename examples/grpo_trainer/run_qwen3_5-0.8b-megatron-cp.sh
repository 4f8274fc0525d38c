#!/usr/bin/env bash
# GRPO on Qwen3.5-0.8B with the Megatron-Core engine and context parallelism 2 on 2 GPUs: responses up to 30k
# tokens, each packed sequence split over the 2 GPUs (docs/advance/megatron.md, "Context parallelism": gated
# attention all-gathers K/V, the Gated DeltaNet state is relayed between the ranks; no Transformer Engine).
# Token budgets are per GPU: a micro-batch holds up to 2 x 16k tokens. vLLM rollout, offload while it generates.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-0.8B (no hub is contacted), e.g. MODEL_PATH=$HOME/models/Qwen3.5-0.8B
# Needs the mcore extra (.venv/bin/pip install -e ".[mcore]": megatron-core >= 0.18, Python 3.12, CUDA).
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-0.8B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
NGPUS=${NGPUS:-2}
MEGA=actor_rollout_ref.actor.megatron

"$PYTHON" -m verl.trainer.main_ppo --config-name ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=32 \
    data.max_prompt_length=1024 \
    data.max_response_length=30720 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    $MEGA.tensor_model_parallel_size=1 \
    $MEGA.context_parallel_size=2 \
    $MEGA.use_remove_padding=True \
    $MEGA.param_offload=True \
    $MEGA.grad_offload=True \
    $MEGA.optimizer_offload=True \
    actor_rollout_ref.ref.megatron.param_offload=True \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name=verl_grpo_example_gsm8k \
    trainer.experiment_name=qwen3_5_0.8b_megatron_cp2 \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 "$@"
