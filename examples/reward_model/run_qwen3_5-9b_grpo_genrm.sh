#!/usr/bin/env bash
# GRPO where a generative reward model (GenRM) judges the responses: upstream's route, reward.reward_model.enable
# with a causal-LM judge plus a custom reward function that receives reward_router_address. Here the function is
# the built-in scorer (pkg://verl.utils.reward_score.genrm): it puts the question (extra_info.question, which
# examples/data_preprocess/gsm8k.py stores) and the response into its prompt template, asks the judge through the
# router, and parses "Score: N" from the verdict; an unusable verdict scores default_score and is counted in
# reward/genrm/verdict_*. The judge runs colocated on the built-in rollout engine. See docs/advance/reward_model.md.
# Data: .venv/bin/python examples/data_preprocess/gsm8k.py --local_save_dir $HOME/data/gsm8k
# Models: local copies, e.g. MODEL_PATH=$HOME/models/Qwen3.5-9B JUDGE_PATH=$HOME/models/Qwen3.5-4B
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen3.5-9B}
JUDGE_PATH=${JUDGE_PATH:-$HOME/models/Qwen3.5-4B}
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
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    reward.reward_model.enable=True \
    reward.reward_model.model_path="$JUDGE_PATH" \
    reward.reward_model.rollout.name=hf \
    reward.reward_model.rollout.dtype=bfloat16 \
    reward.reward_model.rollout.temperature=0.7 \
    reward.reward_model.rollout.top_p=0.8 \
    reward.reward_model.rollout.response_length=512 \
    reward.custom_reward_function.path=pkg://verl.utils.reward_score.genrm \
    reward.custom_reward_function.name=compute_score \
    +reward.custom_reward_function.reward_kwargs.score_min=1 \
    +reward.custom_reward_function.reward_kwargs.score_max=10 \
    +reward.custom_reward_function.reward_kwargs.default_score=0 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.total_epochs=1 "$@"
