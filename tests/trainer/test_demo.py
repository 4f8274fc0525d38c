"""The README's main command: ``python -m verl.trainer.main_ppo`` with no arguments runs the embedded demo
(Ray launcher, tiny Qwen3.5, letter-echo task) and must visibly learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.trainer.e2e_utils import demo_dir


def test_demo_learns_and_plots(tmp_path):
    # As a user runs it: no logger variables, so the metrics go to the run's own directory (issue 25).
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_FILE_LOGGER")}
    env.update(VERL_DEMO_DIR=demo_dir(), PYTHONUNBUFFERED="1")
    env.pop("VERL_CONSOLE_METRICS", None)
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (run_dir,) = (tmp_path / "outputs" / "verl_demo" / "letter_echo" / "runs").iterdir()
    assert f"Run directory: {run_dir} (" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["data"]["critic/score/mean"] for r in records if "critic/score/mean" in r["data"]]
    assert len(scores) >= 20
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert 0.0 <= first <= 1.0 and 0.0 <= last <= 1.0
    # The learning bar: the last five steps average at least 0.3 above the first five.
    assert last - first >= 0.3, (first, last, scores)
    # One short console line per step with the score; the full metrics are in the file only.
    step_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert any(line.startswith("step 1 | score ") and " s/step" in line for line in step_lines), step_lines[:3]
    assert len(step_lines) >= len(scores) and max(map(len, step_lines)) < 160, max(step_lines, key=len)
    png = run_dir / "reward_curve.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
