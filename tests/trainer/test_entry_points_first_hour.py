"""Issue 25, a new user's first commands: ``--help`` and ``--cfg job`` of both entry points answer and run
nothing, and a run's errors come in the order a user can act on (paths and device before the batch-size
arithmetic; an unset ``trainer.device`` follows the host)."""

import os

import pytest
import yaml

from verl.trainer import main_ppo, sft_trainer
from verl.utils.device import get_device_name


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty folder with the demo built elsewhere: anything a run writes shows up in tmp_path."""
    monkeypatch.chdir(tmp_path)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def _sft_main(argv):
    saved = dict(os.environ)
    try:
        return sft_trainer.main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("entry", [main_ppo.main, _sft_main], ids=["main_ppo", "sft_trainer"])
def test_help_answers_and_runs_nothing(entry, in_tmp, capsys):
    assert entry(["--help"]) == 0
    out = capsys.readouterr().out
    module = "main_ppo" if entry is main_ppo.main else "sft_trainer"
    assert out.startswith(f"usage: python -m verl.trainer.{module} ")
    assert "== Configuration groups ==" in out and "--cfg job" in out
    assert list(in_tmp.iterdir()) == []  # no outputs/, no checkpoints/, no metric log


def test_sft_cfg_job_prints_the_config_and_runs_nothing(in_tmp, capsys, monkeypatch):
    monkeypatch.setenv("VERL_DEMO_DIR", str(in_tmp / "demo"))  # a dry run must not build the demo either
    assert _sft_main(["--cfg", "job", "trainer.total_training_steps=7"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["trainer"]["total_training_steps"] == 7 and cfg["trainer"]["project_name"] == "verl_sft_demo"
    assert cfg["data"]["train_files"] == "${verl_sft_demo:train}"  # shown, not built
    assert _sft_main(["--cfg", "job", "--package", "optim", "optim.lr=0.5"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["lr"] == 0.5
    assert list(in_tmp.iterdir()) == []


def test_sft_cfg_job_validates(in_tmp, capsys, monkeypatch):
    monkeypatch.setenv("VERL_DEMO_DIR", str(in_tmp / "demo"))
    assert _sft_main(["--cfg", "job", "data.truncation=middle"]) == 2
    assert "data.truncation='middle'" in capsys.readouterr().err


def test_ppo_wrong_model_path_is_named_before_batch_sizes(in_tmp, capsys):
    """The issue's case: ppo_trainer's required micro-batch keys used to be all the user saw."""
    code = main_ppo.main([f"actor_rollout_ref.model.path={in_tmp}/no_model",
                          f"data.train_files={in_tmp}/train.parquet"])
    err = capsys.readouterr().err
    assert code == 2
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert f"actor_rollout_ref.model.path={in_tmp}/no_model" in problems[0] and "no such directory" in problems[0]
    assert f"{in_tmp}/train.parquet does not exist" in problems[1]
    assert any("ppo_micro_batch_size_per_gpu" in p for p in problems[2:])  # still reported, after the paths


def test_ppo_cfg_job_does_not_check_paths(in_tmp, capsys):
    # A dry run prints a cluster's command on a laptop: the paths need not exist here.
    code = main_ppo.main(["--cfg", "job", f"actor_rollout_ref.model.path={in_tmp}/no_model",
                          "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                          "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                          "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "critic.use_dynamic_bsz=true"])
    captured = capsys.readouterr()
    assert code == 0, captured.err


def test_sft_missing_data_reported_first_and_device_follows_host(in_tmp, capsys):
    """The issue's case: an unset trainer.device (upstream's default cuda) failed first on a CPU host, then
    the placeholder model path, and only the third run named the missing data file."""
    model = in_tmp / "model"
    model.mkdir()
    code = _sft_main([f"model.path={model}", f"data.train_files={in_tmp}/missing.parquet",
                      "data.micro_batch_size_per_gpu=0"])
    err = capsys.readouterr().err
    assert code == 2
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert f"{in_tmp}/missing.parquet does not exist" in problems[0], err
    assert "data.micro_batch_size_per_gpu" in problems[1]
    assert "trainer.device" not in "\n".join(problems)
    if get_device_name() != "cuda":  # the default follows the host, said in one line before the problems
        note = [line for line in err.splitlines() if line.startswith("trainer.device=cuda (from the config) but this host has no cuda")]
        assert len(note) == 1 and f"training on {get_device_name()}" in note[0]


def test_sft_named_wrong_device_is_listed_with_the_paths(in_tmp, capsys):
    wrong = "npu" if get_device_name() != "npu" else "cpu"
    code = _sft_main([f"model.path={in_tmp}/none", f"data.train_files={in_tmp}/missing.parquet",
                      f"trainer.device={wrong}", "data.micro_batch_size_per_gpu=0"])
    problems = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  - ")]
    assert code == 2
    assert "model.path=" in problems[0] and "missing.parquet" in problems[1]
    assert f"`trainer.device={wrong}` but this host runs on" in problems[2]
    assert "data.micro_batch_size_per_gpu" in problems[3]
