#!/usr/bin/env bash
# GRPO on Qwen3.5-35B-A3B (MoE: 256 routed experts + a shared expert, Gated DeltaNet + gated attention) with the
# Megatron-Core engine, 2 nodes x 8 GPUs, packed (THD) sequences, vLLM rollout.
#   TP 2 (attention / GDN heads and the dense parts; the 2 KV heads bound it), EP 8 with ETP 1 (each expert
#   whole on one GPU), PP 1; sequence parallelism is required with TP and EP together.
#   Packing stays on: megatron-core >= 0.18 runs Gated DeltaNet on packed sequences (cu_seqlens), which upstream
#   verl's Qwen3.5 recipe had to turn off (use_remove_padding=False).
#   Parameters, gradients and optimizer state are offloaded while vLLM generates (colocated).
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-35B-A3B (no hub is contacted), e.g. MODEL_PATH=$HOME/models/Qwen3.5-35B-A3B
# Needs the mcore extra (.venv/bin/pip install -e ".[mcore]": megatron-core >= 0.18, Python 3.12, CUDA) and a Ray cluster
# spanning both nodes (ray start --head on node 0, ray start --address=... on node 1, then run this on node 0).
# The parallel sizes are checked against the checkpoint's config before any worker starts.
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-35B-A3B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
NNODES=${NNODES:-2}
NGPUS=${NGPUS:-8}
MEGA=actor_rollout_ref.actor.megatron

"$PYTHON" -m verl.trainer.main_ppo --config-name ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=4096 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.clip_grad=1.0 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    $MEGA.tensor_model_parallel_size=2 \
    $MEGA.pipeline_model_parallel_size=1 \
    $MEGA.expert_model_parallel_size=8 \
    $MEGA.expert_tensor_parallel_size=1 \
    $MEGA.context_parallel_size=1 \
    $MEGA.sequence_parallel=True \
    $MEGA.use_distributed_optimizer=True \
    $MEGA.use_remove_padding=True \
    $MEGA.param_offload=True \
    $MEGA.grad_offload=True \
    $MEGA.optimizer_offload=True \
    $MEGA.override_transformer_config.recompute_granularity=full \
    $MEGA.override_transformer_config.recompute_method=uniform \
    $MEGA.override_transformer_config.recompute_num_layers=1 \
    actor_rollout_ref.ref.megatron.param_offload=True \
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
    trainer.experiment_name=qwen3_5_35b_a3b_megatron \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.nnodes="$NNODES" \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 "$@"
