#!/usr/bin/env bash
# Multi-turn SFT with tool calls, tool results and reasoning on Qwen3.5-9B (FSDP2, 8 GPUs). Only assistant
# turns (their reasoning, tool calls, text and end-of-turn token) are trained; system, user and tool turns are
# context. Each row's tool schemas go to the chat template; enable_thinking is read per row.
#
# Data: your own conversations as OpenAI-style messages or ShareGPT jsonl:
#   .venv/bin/python examples/data_preprocess/multiturn_sft.py --input chats.jsonl --format openai \
#       --test_fraction 0.02 --local_save_dir $HOME/data/multiturn_sft
# or the synthetic calculator task the CPU demo uses:
#   .venv/bin/python examples/data_preprocess/multiturn_sft.py --format demo --num_rows 4096 --test_fraction 0.05 \
#       --local_save_dir $HOME/data/multiturn_sft
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-9B}
DATA_DIR=${DATA_DIR:-$HOME/data/multiturn_sft}
NGPUS=${NGPUS:-8}

"$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NGPUS" -m verl.trainer.sft_trainer \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.messages_key=messages \
    data.tools_key=tools \
    data.enable_thinking_key=enable_thinking \
    data.enable_thinking_default=null \
    data.train_batch_size=128 \
    data.pad_mode=no_padding \
    data.use_dynamic_bsz=True \
    data.max_token_len_per_gpu=16384 \
    data.max_length=8192 \
    data.truncation=error \
    data.ignore_input_ids_mismatch=False \
    model.path="$MODEL_PATH" \
    model.use_remove_padding=True \
    model.enable_gradient_checkpointing=True \
    optim.lr=1e-5 \
    optim.lr_warmup_steps_ratio=0.03 \
    optim.lr_scheduler_type=cosine \
    trainer.device=cuda \
    trainer.n_gpus_per_node="$NGPUS" \
    trainer.project_name=multiturn-sft \
    trainer.experiment_name=qwen3_5-9b-tools \
    trainer.logger='["console","file"]' \
    trainer.total_epochs=2 \
    trainer.save_freq=500 \
    trainer.test_freq=100 "$@"
