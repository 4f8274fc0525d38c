#!/usr/bin/env bash
# GRPO on Qwen3.5-35B-A3B (MoE) with the Megatron-Core engine and router replay R3: the built-in `hf` rollout
# records the experts it routed every prompt and response token to (rollout.enable_rollout_routing_replay=true,
# returned as routed_experts) and every actor forward -- old log-probs and the update, activation recompute in
# backward included -- replays them through megatron-core's RouterReplay
# (actor.megatron.router_replay.mode=R3). The routes follow the packed THD rows, the sequence-parallel slices
# (TP 2 with sequence parallelism) and the expert-parallel layout (EP 4). See docs/advance/router_replay.md.
# R2 instead (router_replay.mode=R2, enable_rollout_routing_replay left false): the old-log-prob pass records the
# actor's own routes and the update replays those.
# Only the hf rollout records routes here (vLLM's are not wired), and on the Megatron engine it generates with an
# HF copy of the policy on every GPU: about 70 GB for this model in bf16, so this layout is meant for 141 GB
# cards (H200). Not run at this size, and the Megatron router-replay path has not run on a GPU yet
# (docs/advance/router_replay.md says what ran where).
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-35B-A3B, e.g. MODEL_PATH=$HOME/models/Qwen3.5-35B-A3B
# Needs the mcore extra (.venv/bin/pip install -e ".[mcore]": megatron-core >= 0.18, Python 3.12, CUDA).
set -xeuo pipefail

PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-35B-A3B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
MEGA=actor_rollout_ref.actor.megatron

"$PYTHON" -m verl.trainer.main_ppo --config-name ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 \
    $MEGA.tensor_model_parallel_size=2 \
    $MEGA.expert_model_parallel_size=4 \
    $MEGA.expert_tensor_parallel_size=1 \
    $MEGA.sequence_parallel=True \
    $MEGA.use_remove_padding=True \
    $MEGA.param_offload=True \
    $MEGA.grad_offload=True \
    $MEGA.optimizer_offload=True \
    $MEGA.override_transformer_config.recompute_granularity=full \
    $MEGA.override_transformer_config.recompute_method=uniform \
    $MEGA.override_transformer_config.recompute_num_layers=1 \
    $MEGA.router_replay.mode=R3 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 \
    trainer.logger='["console"]' \
    trainer.project_name=verl_grpo_example_gsm8k \
    trainer.experiment_name=qwen3_5_35b_a3b_megatron_r3 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 "$@"
