"""Run ``python -m verl.trainer.main_ppo`` as a user would, and read back its file-logger metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def demo_dir() -> str:
    """One demo-asset cache for the whole test session (the assets are deterministic)."""
    d = os.environ.get("VERL_TEST_DEMO_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "verl-test-demo")
    os.makedirs(d, exist_ok=True)
    return d


def _one_rank(overrides: list[str]) -> bool:
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key in ("trainer.n_gpus_per_node", "trainer.nnodes") and value.strip() not in ("1", ""):
            return False
    return True


def run_main_ppo(workdir: Path, overrides: list[str], config_name: str | None = "demo", timeout: int = 900,
                 check: bool = True, env_extra: dict | None = None):
    """Returns (completed process, list of {"step", "data"} records from the file logger).

    A one-rank run without its own ``trainer.launcher`` runs in-process (``trainer.launcher=local``): the
    workers, trainer and engines are the same, and starting a Ray node costs ~15 s per launch, most of these
    tests' time. The Ray path itself is covered by the runs that ask for it (the README demo, several ranks,
    multi-node, a killed worker, the async pools)."""
    if _one_rank(overrides) and not any(o.lstrip("+").startswith("trainer.launcher=") for o in overrides):
        overrides = [*overrides, "trainer.launcher=local"]
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "metrics.jsonl"
    env = dict(os.environ)
    env.update({"VERL_DEMO_DIR": demo_dir(), "VERL_FILE_LOGGER_PATH": str(log), "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo"]
    if config_name:
        cmd += ["--config-name", config_name]
    cmd += [f"trainer.default_local_dir={workdir / 'ckpt'}", "trainer.logger=[console,file]", *overrides]
    proc = subprocess.run(cmd, cwd=str(workdir), env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"main_ppo failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                             f"STDERR:\n{proc.stderr[-6000:]}")
    records = []
    if log.exists():
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return proc, records


def train_records(records: list[dict]) -> dict[int, dict]:
    """Training-step metrics by step (validation-only records have no critic/score)."""
    return {r["step"]: r["data"] for r in records if "critic/score/mean" in r["data"]}


def main_ppo_in_process(monkeypatch, capsys, workdir: Path, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of ``verl.trainer.main_ppo.main`` called in this process, for runs that end in a config
    error before anything is built: the same code path as ``python -m`` without an interpreter's start-up (the
    ``python -m`` runs above exercise that)."""
    from verl.trainer.main_ppo import main

    monkeypatch.setenv("VERL_DEMO_DIR", demo_dir())
    monkeypatch.delenv("VERL_DEBUG", raising=False)
    monkeypatch.chdir(workdir)
    code = main(["--config-name", "demo", f"trainer.default_local_dir={workdir / 'ckpt'}", *argv])
    return code, capsys.readouterr().err
