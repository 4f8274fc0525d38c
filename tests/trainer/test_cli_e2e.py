"""``python -m verl.trainer.main_ppo`` as a user types it (issue 10 items 9 and 11, ReMax's greedy baseline).

* No model path: the embedded demo runs with the overrides applied; seed 003's recommended LoRA command runs
  that way in tests/workers/test_lora_e2e.py::test_demo_still_learns_with_lora, which also shows it learns.
* Data and reward mistakes end in one paragraph naming the file / row / function and what to do, exit 1,
  no traceback unless VERL_DEBUG=1; a missing data file is a config error found before anything loads.
"""

from __future__ import annotations

import json

import pytest

from tests.trainer.e2e_utils import main_ppo_in_process, run_main_ppo, train_records
from verl.trainer import main_ppo

SHORT = ["trainer.total_training_steps=2"]


def _assert_one_paragraph(proc, head: str, *words: str) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(head)]
    assert len(lines) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_remax_uses_a_greedy_baseline(tmp_path):
    proc, records = run_main_ppo(tmp_path, ["algorithm.adv_estimator=remax", "trainer.launcher=local",
                                            "trainer.val_before_train=false", "trainer.test_freq=-1", *SHORT])
    steps = train_records(records)
    assert sorted(steps) == [1, 2]
    # ReMax advantages are reward minus the greedy reward: not all zero, and not the raw rewards' sign alone.
    assert all("critic/advantages/mean" in m for m in steps.values())


def test_missing_data_file(tmp_path, monkeypatch, capsys):
    # Checked before anything loads (issue 25): a config error naming the key and the path, exit 2. In process
    # (main_ppo.main, the `python -m` code path): nothing is built before the error.
    from verl.trainer.config.checks import ConfigValidationError

    missing = tmp_path / "nope" / "train.parquet"
    argv = [f"data.train_files={missing}", "trainer.launcher=local"]
    code, err = main_ppo_in_process(monkeypatch, capsys, tmp_path, argv)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"  - `data.train_files`: {missing} does not exist" in err.splitlines()
    # VERL_DEBUG=1: the same error is raised with its traceback instead of the paragraph.
    monkeypatch.setenv("VERL_DEBUG", "1")
    with pytest.raises(ConfigValidationError, match="data.train_files"):
        main_ppo.main(["--config-name", "demo", *argv])


def test_malformed_row(tmp_path):
    rows = tmp_path / "rows.jsonl"
    good = {"data_source": "letter_echo", "prompt": [{"role": "user", "content": "Repeat: a"}],
            "reward_model": {"ground_truth": "a"}}
    rows.write_text(json.dumps(good) + "\n" + json.dumps({"data_source": "letter_echo", "question": "?"}) + "\n")
    proc, _ = run_main_ppo(tmp_path, [f"data.train_files={rows}", f"data.val_files={rows}",
                                      "trainer.launcher=local"], check=False)
    _assert_one_paragraph(proc, "Data error:", "row 1", str(rows), "data.prompt_key")


def test_reward_function_that_raises(tmp_path):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    raise ZeroDivisionError('bad scorer')\n")
    proc, _ = run_main_ppo(tmp_path, [f"reward.custom_reward_function.path={fn}", "trainer.launcher=local",
                                      *SHORT], check=False)
    _assert_one_paragraph(proc, "Reward error:", "ZeroDivisionError", "bad scorer", str(fn))


def test_reward_manager_without_reward_tensor(tmp_path):
    """A custom reward manager whose dict lacks 'reward_tensor': the check runs after the guarded call, in
    compute_reward, and still ends in one paragraph naming the manager and the expected keys."""
    module = tmp_path / "my_manager.py"
    module.write_text("class NoTensor:\n"
                      "    def __init__(self, **kwargs):\n"
                      "        pass\n"
                      "    def __call__(self, data, return_dict=False):\n"
                      "        return {'scores': [0.0] * len(data)}\n")
    proc, _ = run_main_ppo(tmp_path, ["reward.reward_manager.source=importlib", "reward.reward_manager.name=NoTensor",
                                      f"reward.reward_manager.module.path={module}", "trainer.launcher=local",
                                      *SHORT], check=False)  # fails in the validation before training
    _assert_one_paragraph(proc, "Reward error:", "NoTensor", "'reward_tensor'", "['scores']")
