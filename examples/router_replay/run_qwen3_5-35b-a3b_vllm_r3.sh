#!/usr/bin/env bash
# GRPO on Qwen3.5-35B-A3B (MoE) with router replay R3 and vLLM as the rollout: vLLM records the experts it routed
# every prompt and response token to (rollout.enable_rollout_routing_replay=true builds the engine with
# enable_return_routed_experts=True; each sample's routes come back as routed_experts) and every actor forward --
# old log-probs and the update -- replays them (actor.fsdp_config.router_replay.mode=R3). On Megatron use
# actor.megatron.router_replay.mode=R3 instead. vLLM returns one route row per decoder layer, so models with
# dense decoder layers are refused (every Qwen3.5 MoE layer is MoE). See docs/advance/router_replay.md.
# Built, not run yet: vLLM's CPU build cannot record routes, and the CUDA check
# (tests/workers/rollout/test_vllm_cuda_gpu.py::test_routed_experts_match_the_trainers_router) has not run.
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
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 "$@"
