"""Run the asynchronous entry points as a user would and read back their file-logger metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.trainer.e2e_utils import demo_dir

MODULES = {"one_step_off": "verl.experimental.one_step_off_policy.main_ppo",
           "fully_async": "verl.experimental.fully_async_policy.fully_async_main"}

# Few short steps on the demo: 8 prompts x 4 responses, one update per step, no validation.
FAST = ["trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32"]


def run_async(mode: str, workdir: Path, overrides: list[str], timeout: int = 900, check: bool = True):
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "metrics.jsonl"
    env = dict(os.environ)
    env.update({"VERL_DEMO_DIR": demo_dir(), "VERL_FILE_LOGGER_PATH": str(log), "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    cmd = [sys.executable, "-m", MODULES[mode], f"trainer.default_local_dir={workdir / 'ckpt'}",
           "trainer.logger=[console,file]", *overrides]
    proc = subprocess.run(cmd, cwd=str(workdir), env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{MODULES[mode]} failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return proc, records
