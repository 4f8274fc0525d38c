#!/usr/bin/env bash
# MTP on CPU: builds a tiny random Qwen3.5 whose checkpoint carries an MTP head
# (mtp_num_hidden_layers=1, `mtp.*` tensors), then runs the shipped SFT demo task on it with the MTP loss.
# The log shows `mtp_losses/mtp_1_loss` next to `train/loss`; the HF export under the run directory keeps `mtp.*`.
set -xeuo pipefail

PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-/tmp/tiny_qwen3_5_mtp}
OUT_DIR=${OUT_DIR:-/tmp/tiny_qwen3_5_mtp_sft}

"$PYTHON" -c "from verl.models.qwen3_5.tiny import build_tiny_qwen3_5; build_tiny_qwen3_5('$MODEL_DIR', mtp_num_hidden_layers=1)"

"$PYTHON" -m verl.trainer.sft_trainer --config-name=sft_demo \
    model.path="$MODEL_DIR" \
    model.mtp.enable=true \
    model.mtp.enable_train=true \
    model.mtp.mtp_loss_scaling_factor=0.3 \
    data.train_max_samples=32 \
    data.train_batch_size=8 \
    trainer.total_training_steps=4 \
    trainer.test_freq=-1 \
    trainer.save_freq=4 \
    trainer.resume_mode=disable \
    checkpoint.save_contents='["model","optimizer","extra","hf_model"]' \
    trainer.default_local_dir="$OUT_DIR" \
    trainer.device=cpu "$@"
