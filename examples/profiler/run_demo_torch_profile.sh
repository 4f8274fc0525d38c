#!/usr/bin/env bash
# torch.profiler traces through upstream's profiler keys, on the embedded CPU demo (no model path given, so
# the demo runs with these overrides). Steps 2 and 3 of the actor/rollout worker are traced on rank 0; each
# writes a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev) to
#   $SAVE_PATH/step2/actor_rollout_rank0.json and $SAVE_PATH/step3/actor_rollout_rank0.json
# Add global_profiler.profile_continuous_steps=true for one trace covering both steps.
set -xeuo pipefail

# The project's interpreter: the .venv that `bash scripts/setup.sh` creates (PYTHON=... picks another).
PYTHON=${PYTHON:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python}

SAVE_PATH=${SAVE_PATH:-outputs/profile}

"$PYTHON" -m verl.trainer.main_ppo \
    trainer.total_training_steps=3 \
    trainer.val_before_train=false \
    global_profiler.tool=torch \
    global_profiler.steps='[2,3]' \
    global_profiler.save_path="$SAVE_PATH" \
    actor_rollout_ref.actor.profiler.enable=true \
    actor_rollout_ref.actor.profiler.ranks='[0]' \
    actor_rollout_ref.actor.profiler.tool_config.torch.contents='[cpu,shapes]' "$@"
