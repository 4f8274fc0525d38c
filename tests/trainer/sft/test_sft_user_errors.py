"""SFT mistakes a user fixes end like ``main_ppo``'s: one paragraph naming the key / file / row, a non-zero
exit, no traceback unless VERL_DEBUG=1 (issue 10 item 11 for ``python -m verl.trainer.sft_trainer``)."""

import os
import subprocess
import sys

import pytest

from tests.trainer.sft.test_sft_trainer import _env, run_in_process
from verl.utils.user_errors import UserFacingError


def _one_paragraph(stderr: str, head: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith(head)]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_missing_data_file_is_one_paragraph(tmp_path):
    """The audit's command: it used to end in a `[rank0]` traceback whose message said "RLHFDataset". The
    file is now checked before anything loads (issue 25): a config error naming the key and the path."""
    missing = tmp_path / "missing.parquet"
    cmd = [sys.executable, "-m", "verl.trainer.sft_trainer", "--config-name", "sft_demo",
           f"data.train_files={missing}", f"trainer.default_local_dir={tmp_path}/out"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "RLHFDataset" not in proc.stderr
    assert "Config error:\n1 problem(s)" in proc.stderr, proc.stderr[-3000:]
    assert f"`data.train_files`: {missing} does not exist" in proc.stderr
    debug = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, VERL_DEBUG="1"), capture_output=True, text=True,
                           timeout=300)
    # VERL_DEBUG=1 asks for the traceback.
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigValidationError" in debug.stderr


def _main_in_process(argv):
    """``sft_trainer.main`` in this process, with the environment its process group set-up writes restored."""
    from verl.trainer.sft_trainer import main

    saved = dict(os.environ)
    try:
        return main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("workers", [0, 1], ids=["in_process", "loader_worker"])
def test_row_that_fails_while_loading_names_the_row(tmp_path, capsys, workers):
    """A conversation longer than data.max_length (truncation=error) fails only when the row is tokenised,
    i.e. inside the DataLoader - in a worker process with num_workers > 0, which cannot re-raise the error
    as itself; either way the user gets one paragraph naming the row and the key."""
    code = _main_in_process([f"trainer.default_local_dir={tmp_path}", "trainer.logger=[console]",
                             "trainer.total_training_steps=1", "data.max_length=24", f"data.num_workers={workers}",
                             "data.train_max_samples=16"])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    line = _one_paragraph(err, "Data error:")
    assert "longer than data.max_length=24" in line and "row " in line and "data.train_files" in line, line


def test_train_batch_larger_than_the_data(tmp_path, capsys):
    code = _main_in_process([f"trainer.default_local_dir={tmp_path}", "trainer.logger=[console]",
                             "data.train_max_samples=4", "data.train_batch_size=8"])
    line = _one_paragraph(capsys.readouterr().err, "Data error:")
    assert code == 1 and "data.train_batch_size=8" in line and "4 rows" in line, line


def test_bad_model_path_names_sfts_key(tmp_path, capsys):
    # Naming a model switches to upstream's defaults (cuda, no data), so the device and data are given too.
    code = _main_in_process([f"model.path={tmp_path}/no_model", "trainer.logger=[console]", "trainer.device=cpu",
                             f"data.train_files={tmp_path}/train.parquet", f"trainer.default_local_dir={tmp_path}"])
    err = capsys.readouterr().err
    # Checked before loading (issue 25), under SFT's key, not the RL one the shared tokenizer loader would name.
    assert code == 2 and "Traceback" not in err, err
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert problems[0].startswith(f"  - `model.path={tmp_path}/no_model`: no such directory"), err
    assert "actor_rollout_ref" not in err, err


def test_token_budget_error_names_the_sft_key(tmp_path):
    """Dynamic batch size with a budget below the longest conversation: the error names SFT's key
    (data.max_token_len_per_gpu), not the RL actor's ppo_max_token_len_per_gpu."""
    with pytest.raises(UserFacingError) as err:
        run_in_process(tmp_path, ["data.train_max_samples=8", "data.train_batch_size=8",
                                  "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=32",
                                  "trainer.total_training_steps=1", "trainer.test_freq=-1"])
    text = err.value.paragraph()
    assert text.startswith("Config error:") and "data.max_token_len_per_gpu" in text, text
    assert "ppo_max_token_len_per_gpu" not in text, text
