#!/usr/bin/env bash
# DAPO on the embedded demo (tiny Qwen3.5, letter-echo task, CPU, no downloads): a few steps that exercise
# dynamic sampling, the dapo reward manager and token-level rollout correction. Each step's console line adds
# train/num_gen_batches, training/rollout_probs_diff_* and rollout_corr/* (VERL_CONSOLE_METRICS); every metric
# is in the run directory's metrics.jsonl.
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}
export VERL_CONSOLE_METRICS=${VERL_CONSOLE_METRICS:-train/num_gen_batches,training/rollout_probs_diff_*,rollout_corr/*}

"$PYTHON" -m verl.trainer.main_ppo --config-name demo \
    trainer.total_training_steps=${STEPS:-5} \
    trainer.val_before_train=False \
    trainer.test_freq=-1 \
    data.gen_batch_size=8 \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.max_num_gen_batches=20 \
    algorithm.rollout_correction.rollout_is=token \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    reward.reward_manager.name=dapo \
    +reward.reward_kwargs.max_resp_len=6 \
    +reward.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward.reward_kwargs.overlong_buffer_cfg.len=2 \
    +reward.reward_kwargs.overlong_buffer_cfg.log=True "$@"
