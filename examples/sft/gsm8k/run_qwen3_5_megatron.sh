#!/usr/bin/env bash
# SFT of Qwen3.5-397B-A17B on GSM8K with the Megatron engine: 16 nodes x 8 GPUs (128 GPUs), torchrun on
# every node (NODE_RANK 0..NNODES-1, MASTER_ADDR = node 0).
#
# Model (read the checkpoint's config.json for the exact numbers): a hybrid MoE decoder of 60 layers laid
# out as 15 blocks of [3 x (Gated DeltaNet -> MoE), 1 x (gated full attention -> MoE)]; hidden size 4096;
# 512 routed experts (10 active per token) plus one shared expert with a sigmoid gate; ~17B parameters
# active of ~397B. Full attention uses q/k norm, partial rotary and few KV heads; Gated DeltaNet layers keep a
# recurrent state instead of a KV cache.
#
# Parallel layout: TP 2 x PP 4 (15 layers per stage) for the dense parts, EP 32 for the experts (16 experts
# per rank and layer), distributed optimizer over the remaining data-parallel ranks. Sequences are packed
# (data.pad_mode=no_padding): megatron-core >= 0.18 runs Gated DeltaNet on packed (THD) sequences, which
# upstream verl could not (it had to set use_remove_padding=False).
#
# Data: .venv/bin/python examples/data_preprocess/gsm8k_multiturn_sft.py --local_save_dir $HOME/data/gsm8k_sft
# Needs the mcore extra (.venv/bin/pip install -e ".[mcore]"); see docs/sft.md.
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-397B-A17B}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k_sft}
NNODES=${NNODES:-16}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-2}
PP=${PP:-4}
EP=${EP:-32}
CP=${CP:-1}

"$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$GPUS_PER_NODE" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    -m verl.trainer.sft_trainer \
    engine=megatron \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.messages_key=messages \
    data.train_batch_size=256 \
    data.pad_mode=no_padding \
    data.use_dynamic_bsz=True \
    data.max_token_len_per_gpu=8192 \
    data.max_length=2048 \
    data.truncation=error \
    data.num_workers=4 \
    model.path="$MODEL_PATH" \
    model.use_remove_padding=True \
    engine.use_remove_padding=True \
    engine.tensor_model_parallel_size="$TP" \
    engine.pipeline_model_parallel_size="$PP" \
    engine.expert_model_parallel_size="$EP" \
    engine.context_parallel_size="$CP" \
    engine.sequence_parallel=True \
    engine.use_distributed_optimizer=True \
    engine.override_transformer_config.recompute_granularity=full \
    engine.override_transformer_config.recompute_method=uniform \
    engine.override_transformer_config.recompute_num_layers=1 \
    optim.lr=1e-5 \
    optim.lr_warmup_steps_ratio=0.05 \
    optim.lr_decay_style=cosine \
    optim.min_lr=1e-6 \
    optim.weight_decay=0.01 \
    optim.clip_grad=1.0 \
    checkpoint.save_contents='["model","optimizer","extra"]' \
    trainer.device=cuda \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$GPUS_PER_NODE" \
    trainer.project_name=gsm8k-sft \
    trainer.experiment_name=qwen3_5-397b-a17b-megatron \
    trainer.logger='["console","file"]' \
    trainer.total_epochs=2 \
    trainer.save_freq=after_each_epoch \
    trainer.test_freq=50 \
    trainer.resume_mode=auto "$@"
