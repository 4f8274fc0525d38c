#!/usr/bin/env bash
# Speculative decoding with the MTP head on CPU: builds a tiny random Qwen3.5 whose checkpoint carries an MTP head
# (mtp_num_hidden_layers=1, `mtp.*` tensors), then runs GRPO on the embedded demo task (the `demo` config) with
# the built-in `hf` rollout drafting 2 tokens per step with the head (mtp.enable_rollout) while the MTP loss trains
# it (mtp.enable_train). The log shows rollout/spec_accept_rate, rollout/spec_accept_length (upstream's names)
# and perf/hf_engine/spec_* next to actor/mtp_losses/mtp_1_loss. See docs/advance/mtp.md.
# Usage: bash examples/mtp/run_qwen3_5_tiny_grpo_mtp_spec_cpu.sh [extra overrides]
set -xeuo pipefail

PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-/tmp/tiny_qwen3_5_mtp}
OUT_DIR=${OUT_DIR:-/tmp/tiny_qwen3_5_mtp_spec_grpo}

"$PYTHON" -c "from verl.models.qwen3_5.tiny import build_tiny_qwen3_5; build_tiny_qwen3_5('$MODEL_DIR', mtp_num_hidden_layers=1)"

"$PYTHON" -m verl.trainer.main_ppo --config-name demo \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.model.mtp.enable=true \
    actor_rollout_ref.model.mtp.enable_train=true \
    actor_rollout_ref.model.mtp.enable_rollout=true \
    actor_rollout_ref.model.mtp.num_speculative_tokens=2 \
    actor_rollout_ref.rollout.name=hf \
    data.train_batch_size=8 \
    data.max_response_length=16 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.n=4 \
    trainer.launcher=local \
    trainer.val_before_train=false \
    trainer.test_freq=-1 \
    trainer.total_training_steps=4 \
    trainer.default_local_dir="$OUT_DIR" "$@"
