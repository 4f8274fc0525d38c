#!/usr/bin/env bash
# SFT of Qwen3.5-9B on GSM8K with the FSDP2 engine, one node of 8 GPUs, packed sequences.
# Data: .venv/bin/python examples/data_preprocess/gsm8k_multiturn_sft.py --local_save_dir $HOME/data/gsm8k_sft
# Model: a local copy (no hub is contacted), e.g. MODEL_PATH=$HOME/models/Qwen3.5-9B
# LoRA instead of full fine-tuning: add model.lora_rank=64 model.lora_alpha=128 optim.lr=1e-4
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-9B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k_sft}
NGPUS=${NGPUS:-8}

"$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NGPUS" -m verl.trainer.sft_trainer \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.messages_key=messages \
    data.train_batch_size=256 \
    data.micro_batch_size_per_gpu=4 \
    data.pad_mode=no_padding \
    data.use_dynamic_bsz=True \
    data.max_token_len_per_gpu=16384 \
    data.max_length=2048 \
    model.path="$MODEL_PATH" \
    model.use_remove_padding=True \
    model.enable_gradient_checkpointing=True \
    engine=fsdp \
    optim.lr=1e-5 \
    optim.lr_warmup_steps_ratio=0.05 \
    optim.lr_scheduler_type=cosine \
    optim.weight_decay=0.01 \
    checkpoint.save_contents='["model","optimizer","extra","hf_model"]' \
    trainer.device=cuda \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.project_name=gsm8k-sft \
    trainer.experiment_name=qwen3_5-9b-fsdp \
    trainer.logger='["console","file"]' \
    trainer.total_epochs=3 \
    trainer.save_freq=after_each_epoch \
    trainer.test_freq=after_each_epoch "$@"
