"""Issue 25: one short console line per step (what the user watches), every metric in the file logger, and
each run's outputs in a directory of its own."""

import json
import os

import pytest

from verl.utils.tracking import Tracking, console_line, new_run_dir

# A slice of a GRPO step's ~60 metrics.
PPO_STEP = {"critic/score/mean": 0.53125, "critic/score/max": 1.0, "actor/pg_loss": -0.0123, "actor/entropy": 2.5,
            "actor/grad_norm": 0.7, "timing_s/step": 1.234, "timing_s/gen": 0.5, "perf/throughput": 812.0,
            "response_length/mean": 4.0, "training/global_step": 12}


def test_ppo_step_line_is_short_and_has_the_score():
    line = console_line(PPO_STEP, 12)
    assert line == "step 12 | score 0.531 | loss -0.012 | 1.23 s/step"


def test_sft_step_and_validation_lines():
    assert console_line({"train/loss": 2.5, "train/step_time(s)": 0.5, "train/lr": 1e-3, "val/loss": 2.0}, 3) == (
        "step 3 | loss 2.500 | val loss 2.000 | 0.50 s/step")
    # A validation-only step (before training) shows the greedy score of each data source.
    val = {"val-core/letter_echo/reward/mean@1": 0.25, "val-aux/letter_echo/reward/std@1": 0.1}
    assert console_line(val, 0) == "step 0 | val letter_echo 0.250"


def test_watched_metrics_are_added_by_key_or_pattern():
    line = console_line(PPO_STEP, 1, watch="actor/entropy, perf/*,missing/key")
    assert line.endswith("| actor/entropy 2.500 | perf/throughput 812.0")
    # A headline metric named again is not repeated.
    assert console_line(PPO_STEP, 1, watch="critic/score/mean").count("0.531") == 1


def test_small_and_large_values_stay_readable():
    line = console_line({"actor/pg_loss": -3.2e-05, "critic/score/mean": 0.0, "timing_s/step": 0.5}, 1,
                        watch="perf/*")
    assert line == "step 1 | score 0.000 | loss -3.2e-05 | 0.50 s/step"
    assert console_line({"perf/total_num_tokens": 123456}, 1, watch="perf/*") == "step 1 | perf/total_num_tokens 123456"
    assert console_line({"perf/x": 123456.0}, 1, watch="perf/*") == "step 1 | perf/x 1.235e+05"


def test_all_prints_every_metric():
    line = console_line(PPO_STEP, 5, watch="all")
    assert line.startswith("step:5 - ") and all(k in line for k in PPO_STEP)


def test_console_logger_reads_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("VERL_CONSOLE_METRICS", "response_length/mean")
    Tracking("p", "e", default_backend=["console"]).log(PPO_STEP, step=2)
    assert capsys.readouterr().out == "step 2 | score 0.531 | loss -0.012 | 1.23 s/step | response_length/mean 4.000\n"


def test_run_dirs_are_fresh_per_run(tmp_path):
    first, second = new_run_dir(str(tmp_path / "out")), new_run_dir(str(tmp_path / "out"))
    assert first != second and os.path.dirname(first) == str(tmp_path / "out" / "runs")
    assert os.listdir(first) == os.listdir(second) == []


@pytest.fixture
def no_logger_env(monkeypatch, tmp_path):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)


def test_file_logger_writes_everything_to_the_run_dir(tmp_path, no_logger_env):
    run_dir = new_run_dir(str(tmp_path / "out"))
    tracker = Tracking("p", "e", default_backend=["console", "file"], run_dir=run_dir)
    tracker.log(PPO_STEP, step=1)
    tracker.finish()
    (record,) = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert record == {"step": 1, "data": PPO_STEP}
    # A second run starts its own log instead of appending with restarted step numbers.
    again = Tracking("p", "e", default_backend=["file"], run_dir=new_run_dir(str(tmp_path / "out")))
    assert again.loggers["file"].path != os.path.join(run_dir, "metrics.jsonl")
    again.finish()


def test_upstream_logger_variables_still_decide(tmp_path, monkeypatch, no_logger_env):
    run_dir = new_run_dir(str(tmp_path / "out"))
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "logs"))
    tracker = Tracking("p", "e", default_backend=["file"], run_dir=run_dir)
    assert tracker.loggers["file"].path == str(tmp_path / "logs" / "p" / "e.jsonl")
    tracker.finish()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "x.jsonl"))
    tracker = Tracking("p", "e", default_backend=["file"], run_dir=run_dir)
    assert tracker.loggers["file"].path == str(tmp_path / "x.jsonl")
    tracker.finish()
    # Without a run directory (a caller using upstream's signature): upstream's ./<project>/<experiment>.jsonl.
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH")
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT")
    tracker = Tracking("p", "e", default_backend=["file"])
    assert tracker.loggers["file"].path == os.path.join(".", "p", "e.jsonl")
    tracker.finish()
