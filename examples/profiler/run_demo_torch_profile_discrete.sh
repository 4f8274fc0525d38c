#!/usr/bin/env bash
# One torch.profiler trace per task (upstream's tool_config.torch.discrete=true) on the embedded CPU demo: in
# step 2 the actor's old-log-prob pass and its update each write their own Chrome trace, and so does the
# rollout's generation, on rank 0:
#   $SAVE_PATH/step2/actor_rollout_rank0_rollout_generate.json
#   $SAVE_PATH/step2/actor_rollout_rank0_actor_compute_log_prob.json
#   $SAVE_PATH/step2/actor_rollout_rank0_actor_update.json
# See docs/advance/profiling.md.
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

SAVE_PATH=${SAVE_PATH:-outputs/profile_discrete}

"$PYTHON" -m verl.trainer.main_ppo \
    trainer.total_training_steps=2 \
    trainer.val_before_train=false \
    global_profiler.tool=torch \
    global_profiler.steps='[2]' \
    global_profiler.save_path="$SAVE_PATH" \
    actor_rollout_ref.actor.profiler.enable=true \
    actor_rollout_ref.actor.profiler.ranks='[0]' \
    actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true \
    actor_rollout_ref.rollout.profiler.enable=true \
    actor_rollout_ref.rollout.profiler.ranks='[0]' \
    actor_rollout_ref.rollout.profiler.tool_config.torch.discrete=true "$@"
