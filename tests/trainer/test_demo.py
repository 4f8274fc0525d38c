"""The README's main command: ``python -m verl.trainer.main_ppo`` with no arguments runs the embedded demo
(Ray launcher, tiny Qwen3.5, letter-echo task) and must visibly learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.trainer.e2e_utils import demo_dir


def test_demo_learns_and_plots(tmp_path):
    log = tmp_path / "metrics.jsonl"
    env = dict(os.environ, VERL_DEMO_DIR=demo_dir(), VERL_FILE_LOGGER_PATH=str(log), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    scores = [r["data"]["critic/score/mean"] for r in records if "critic/score/mean" in r["data"]]
    assert len(scores) >= 20
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert 0.0 <= first <= 1.0 and 0.0 <= last <= 1.0
    # The learning bar: the last five steps average at least 0.3 above the first five.
    assert last - first >= 0.3, (first, last, scores)
    assert "step:1 " in proc.stdout and "critic/score/mean" in proc.stdout  # per-step scores are printed
    png = tmp_path / "outputs" / "verl_demo" / "letter_echo" / "reward_curve.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
