"""The SFT trainer end to end on CPU through the training-engine interface: the embedded default learns,
metrics and the loss curve are written, and resuming from a checkpoint continues exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _env(tmp_path, **extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", VERL_CPU_THREADS="1", **extra)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # left behind by in-process runs; each launch picks its own
    return env


def run_in_process(tmp_path, overrides):
    import torch.distributed as dist

    from verl.trainer.sft_trainer import load_config, run_sft

    cfg, strategy = load_config([f"trainer.default_local_dir={tmp_path}/ckpt",
                                 "trainer.logger=[console]", *overrides])
    saved = dict(os.environ)
    try:
        return run_sft(cfg, strategy)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)  # the next in-process run makes a fresh group on a fresh port


def test_embedded_default_learns(tmp_path):
    """`python -m verl.trainer.sft_trainer` (the embedded demo; fewer steps to keep the test short): the
    training loss falls to at most half its first value, metrics reach the file logger, a loss curve is drawn."""
    log = tmp_path / "metrics.jsonl"
    steps = 8
    cmd = [sys.executable, "-m", "verl.trainer.sft_trainer", f"trainer.total_training_steps={steps}",
           "trainer.test_freq=4"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, VERL_FILE_LOGGER_PATH=str(log)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    losses = [r["data"]["train/loss"] for r in records]
    assert losses[-1] <= 0.5 * losses[0], losses
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_second", "train/global_tokens"):
        assert key in records[0]["data"]
    val = [r["data"]["val/loss"] for r in records if "val/loss" in r["data"]]
    assert len(val) == 2 and val[1] < val[0]
    (run_dir,) = (tmp_path / "outputs" / "verl_sft_demo" / "calculator_calls" / "runs").iterdir()
    assert (run_dir / "loss_curve.png").stat().st_size > 0  # in the run's own directory (issue 25)
    assert "step 1 | loss " in proc.stdout and "train/grad_norm" not in proc.stdout  # the short console line


COMMON = ["trainer.total_training_steps=4", "trainer.test_freq=4", "data.train_max_samples=64",
          "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "data.val_max_samples=8"]


def test_resume_is_exact(tmp_path, straight):
    common = COMMON
    first = run_in_process(tmp_path / "b", [*common, "trainer.save_freq=2", "trainer.total_training_steps=2",
                                            "trainer.resume_mode=disable"])
    assert (tmp_path / "b" / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    resumed = run_in_process(tmp_path / "b", [*common, "trainer.save_freq=2", "trainer.resume_mode=auto"])
    a = straight["history"]
    b = first["history"] + resumed["history"]
    assert [h["training/global_step"] for h in b] == [1, 2, 3, 4]
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        assert [h[key] for h in b] == [h[key] for h in a], key
    assert b[-1]["val/loss"] == a[-1]["val/loss"]
    assert sorted(os.listdir(tmp_path / "b" / "ckpt")) == ["global_step_2", "global_step_4",
                                                           "latest_checkpointed_iteration.txt", "runs"]
    # Each of the two runs has its own directory and curve: the resumed run did not replace the first's.
    runs = sorted((tmp_path / "b" / "ckpt" / "runs").iterdir())
    assert [r.name for r in runs] == sorted([Path(first["run_dir"]).name, Path(resumed["run_dir"]).name])
    assert all((r / "loss_curve.png").exists() for r in runs)
