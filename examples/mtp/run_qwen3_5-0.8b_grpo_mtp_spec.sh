#!/usr/bin/env bash
# GRPO on one GPU with the built-in `hf` rollout drafting with the checkpoint's MTP head (speculative decoding,
# actor_rollout_ref.model.mtp.enable_rollout; one draft token per step, Qwen3.5's usual setting), while the MTP
# loss keeps the head trained on the policy's own samples. NOT RUN here: no GPU run of this feature was made
# (the CPU path is covered by tests and run_qwen3_5_tiny_grpo_mtp_spec_cpu.sh). Speculative steps run eagerly (no
# CUDA graphs; the engine warns), so compare rollout time with and without enable_rollout before keeping it on:
# benchmarks/bench_speculative.py measures the two on one model. See docs/advance/mtp.md.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Model: a local copy of Qwen3.5-0.8B with its mtp.* weights, e.g. MODEL_PATH=$HOME/models/Qwen3.5-0.8B
set -xeuo pipefail

PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-0.8B}
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
    actor_rollout_ref.model.mtp.enable=True \
    actor_rollout_ref.model.mtp.enable_train=True \
    actor_rollout_ref.model.mtp.enable_rollout=True \
    actor_rollout_ref.model.mtp.num_speculative_tokens=1 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.max_num_seqs=256 \
    actor_rollout_ref.rollout.max_num_batched_tokens=16384 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 "$@"
