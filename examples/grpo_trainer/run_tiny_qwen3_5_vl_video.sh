#!/usr/bin/env bash
# Video GRPO at tiny scale, on the CPU: a tiny random Qwen3.5-VL model, short synthetic clips
# stored as decoded frames (examples/data_preprocess/make_tiny_vl_videos.py), the built-in `hf` rollout and the
# FSDP actor (the CPU `demo` config). The data keys are those of upstream's run_qwen3_5_2b_video_fsdp.sh;
# data.image_patch_size is the tiny vision tower's patch size (4) where Qwen3.5-2B's is 16.
# See docs/advance/qwen3_5.md, "Video inputs".
# Usage: bash examples/grpo_trainer/run_tiny_qwen3_5_vl_video.sh [extra overrides]
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

WORK=${WORK:-$HOME/data/tiny_vl_video_grpo}
MODEL_PATH=${MODEL_PATH:-$WORK/model}
DATA_DIR=${DATA_DIR:-$WORK/data}

# A tiny random VL checkpoint with its tokenizer and processor (no hub access), and the clips.
"$PYTHON" -c "import sys; from verl.models.qwen3_5.tiny import build_tiny_qwen3_5; build_tiny_qwen3_5(sys.argv[1], kind='vl')" "$MODEL_PATH"
"$PYTHON" "$REPO/examples/data_preprocess/make_tiny_vl_videos.py" --local_save_dir "$DATA_DIR"

"$PYTHON" -m verl.trainer.main_ppo --config-name demo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.train_batch_size=4 \
    data.max_prompt_length=128 \
    data.max_response_length=8 \
    data.filter_overlong_prompts=True \
    data.truncation=error \
    data.image_patch_size=4 \
    data.video_key=videos \
    data.shuffle=False \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.01 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0.001 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    trainer.launcher=local \
    trainer.critic_warmup=0 \
    trainer.logger=[console] \
    trainer.val_before_train=False \
    trainer.test_freq=-1 \
    trainer.total_training_steps=4 "$@"
