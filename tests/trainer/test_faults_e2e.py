"""Faults injected into real ``python -m verl.trainer.main_ppo`` runs of the CPU demo model, each compared with one
uninterrupted run: after the fault the run says what happened, and ``trainer.resume_mode=auto`` gives the same
metrics for the following steps (fp32: rel 1e-6).

* SIGTERM mid-step (what a scheduler sends before it preempts): exit 143, the step saved;
* a Ray worker SIGKILLed mid-step (what the OOM killer does): the driver names the rank and its roles and exits 1
  within a bounded time, though the worker never answers;
* a full disk while saving (``torch.save`` raising ENOSPC in the worker): exit 1, the previous checkpoint marked;
* then a truncated shard: the resume is refused naming the file.

The killed worker's run resumes with the in-process launcher (the same numbers as one Ray worker, and faster).
These runs also hold the checks of an uninterrupted resume (``trainer.save_freq``, the checkpoint layout).

The runs are started in two waves of parallel processes (the faults first, then the resumes) so that the module
costs about three sequential runs. The same faults with stand-in workers (and the error modes) are in
test_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.trainer.e2e_utils import REPO, demo_dir, train_records

STEPS = 4
FAST = ["trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", f"trainer.total_training_steps={STEPS}",
        "trainer.logger=[console,file]"]
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "actor/entropy")

# The disk fills up while step 4's optimizer state is written (in the worker: the real checkpoint manager).
DISK_FULL = """
import errno, sys, torch
real = torch.save
def save(obj, f, *a, **kw):
    if "global_step_4" in str(f) and "optim_" in str(f):
        with open(f, "wb") as fh:
            fh.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device", str(f))
    return real(obj, f, *a, **kw)
torch.save = save
from verl.trainer.main_ppo import main
sys.exit(main(sys.argv[1:]))
"""


class Run:
    """One ``main_ppo`` process writing its output to files; ``wait_for(text)`` follows its stdout."""

    def __init__(self, workdir: Path, overrides: list[str], launcher: str = "local", code: str | None = None,
                 name: str = "run"):
        workdir.mkdir(parents=True, exist_ok=True)
        self.dir, self.log, self.name = workdir, workdir / f"{name}.metrics.jsonl", name
        env = dict(os.environ, VERL_DEMO_DIR=demo_dir(), VERL_FILE_LOGGER_PATH=str(self.log), PYTHONUNBUFFERED="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
        entry = ["-c", code] if code else ["-m", "verl.trainer.main_ppo"]
        cmd = [sys.executable, *entry, f"trainer.default_local_dir={workdir / 'ckpt'}", f"trainer.launcher={launcher}",
               *FAST, *overrides]
        self.out, self.err = open(workdir / f"{name}.stdout", "w"), open(workdir / f"{name}.stderr", "w")
        self.proc = subprocess.Popen(cmd, cwd=str(workdir), env=env, stdout=self.out, stderr=self.err)
        self.exited_at: float | None = None

    def wait_for(self, text: str, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while text not in self.stdout:
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"{self.dir.name}/{self.name}: {text!r} never appeared\n{self.stderr[-3000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 900) -> int:
        code = self.proc.wait(timeout=timeout)
        self.exited_at = self.exited_at or time.time()
        self.out.close(), self.err.close()
        return code

    @property
    def stdout(self) -> str:
        return (self.dir / f"{self.name}.stdout").read_text()

    @property
    def stderr(self) -> str:
        return (self.dir / f"{self.name}.stderr").read_text()

    def steps(self) -> dict[int, dict]:
        import json

        if not self.log.exists():
            return {}
        return train_records([json.loads(line) for line in self.log.read_text().splitlines() if line.strip()])


def _worker_processes(driver_pid: int):
    """The Ray worker processes this driver started (its descendants running the colocated worker actor)."""
    import psutil

    out = []
    for p in psutil.Process(driver_pid).children(recursive=True):
        try:
            if "RayColocatedWorker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _kill_worker_after(run: Run, text: str, record: dict) -> None:
    """SIGKILL the run's (only) worker process once ``text`` is printed; what went wrong goes to ``record``."""
    try:
        run.wait_for(text)
        workers = _worker_processes(run.proc.pid)
        assert len(workers) == 1, [(p.pid, p.cmdline()) for p in workers]
        record["pid"] = workers[0].pid
        workers[0].send_signal(signal.SIGKILL)
        record["killed_at"] = time.time()
        run.proc.wait(timeout=300)  # bounded: a hang fails here
        run.exited_at = time.time()
    except Exception as err:  # noqa: BLE001 - reported by the test
        record["error"] = repr(err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("psutil")
    root = tmp_path_factory.mktemp("faults_e2e")
    out: dict = {}
    # Wave 1: the uninterrupted run and the three faults, in parallel.
    straight = Run(root / "straight", [])
    sigterm = Run(root / "sigterm", [])
    dead = Run(root / "dead_worker", ["trainer.save_freq=1"], launcher="ray")
    disk = Run(root / "disk_full", ["trainer.save_freq=2"], code=DISK_FULL)
    killer = threading.Thread(target=_kill_worker_after, args=(dead, "step 2 |", out.setdefault("kill", {})))
    killer.start()
    sigterm.wait_for("step 1 |")
    sigterm.proc.send_signal(signal.SIGTERM)  # lands in step 2 (or the start of step 3)
    out["straight"], out["sigterm"], out["disk_full"] = straight, sigterm, disk
    for r in (straight, sigterm, disk):
        r.finish()
    killer.join(timeout=600)
    dead.finish()
    out["dead_worker"] = dead
    assert straight.proc.returncode == 0, straight.stderr[-4000:]
    # Wave 2: every interrupted run resumes (resume_mode=auto, the default) in place, in parallel.
    resumes = {name: Run(out[name].dir, ["trainer.save_freq=2"] if name == "disk_full" else [], name="resumed")
               for name in ("sigterm", "dead_worker", "disk_full")}
    for name, r in resumes.items():
        r.finish()
        out[f"{name}_resumed"] = r
    return out


def _same_metrics(runs, name: str, steps) -> None:
    want, got = runs["straight"].steps(), runs[f"{name}_resumed"].steps()
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        for key in KEYS:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-7), (name, step, key)


def _resumed_from(runs, name: str) -> int:
    text = runs[f"{name}_resumed"].stdout
    assert "Resuming from" in text, runs[f"{name}_resumed"].stderr[-3000:]
    return int(text.split("Resuming from")[1].split("(global step ")[1].split(")")[0])


def test_sigterm_mid_step_saves_exits_143_and_resumes_to_the_same_metrics(runs):
    r = runs["sigterm"]
    assert r.proc.returncode == 143, r.stderr[-4000:]
    saved = _resumed_from(runs, "sigterm")
    assert 1 <= saved < STEPS  # step 1 when the signal lands as step 1 is logged (saved all the same)
    assert f"SIGTERM received: stopped after step {saved}; checkpoint" in r.stderr
    assert (r.dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(saved)
    assert sorted(r.steps()) == list(range(1, saved + 1))  # the interrupted step finished and was logged
    assert runs["sigterm_resumed"].proc.returncode == 0
    _same_metrics(runs, "sigterm", range(saved + 1, STEPS + 1))


def test_checkpoint_layout(runs):
    """What a step directory holds (upstream's layout, plus the manifest), and trainer.save_freq's rhythm."""
    ckpt = runs["sigterm"].dir / "ckpt"
    step = ckpt / f"global_step_{_resumed_from(runs, 'sigterm')}"
    actor = step / "actor"
    for name in ("model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt", "extra_state_world_size_1_rank_0.pt",
                 "huggingface/config.json"):
        assert (actor / name).exists(), name
    assert (step / "data.pt").exists() and (step / "checkpoint_manifest.json").exists()
    assert not list(ckpt.rglob("*.tmp"))
    saved = sorted(p.name for p in (runs["dead_worker"].dir / "ckpt").glob("global_step_*"))
    assert saved[:2] == ["global_step_1", "global_step_2"]  # trainer.save_freq=1: every step


def test_a_killed_ray_worker_is_named_and_the_driver_exits_promptly(runs):
    r, kill = runs["dead_worker"], runs["kill"]
    assert "pid" in kill and "error" not in kill, (kill, r.stderr[-4000:])
    assert r.proc.returncode == 1, r.stderr[-4000:]
    paragraph = r.stderr.strip().splitlines()[-1]
    assert paragraph.startswith(f"Worker error: the worker process of rank 0 (pid {kill['pid']} on "), paragraph
    assert "hosting actor_rollout, died while running actor_rollout." in paragraph
    assert r.exited_at - kill["killed_at"] < 120  # not the collective's or Ray's long timeouts
    saved = _resumed_from(runs, "dead_worker")  # save_freq=1: the last step finished before the kill
    assert saved >= 2
    assert runs["dead_worker_resumed"].proc.returncode == 0
    _same_metrics(runs, "dead_worker", range(saved + 1, STEPS + 1))


def test_disk_full_keeps_the_previous_checkpoint_and_resumes_from_it(runs):
    r = runs["disk_full"]
    ckpt = r.dir / "ckpt"
    assert r.proc.returncode == 1, r.stderr[-4000:]
    paragraph = r.stderr.strip().splitlines()[-1]
    assert paragraph.startswith(f"Checkpoint error: saving the checkpoint {ckpt / 'global_step_4'} failed "), paragraph
    assert "No space left on device" in paragraph and f"{ckpt / 'global_step_2'} is still the latest" in paragraph
    assert _resumed_from(runs, "disk_full") == 2
    _same_metrics(runs, "disk_full", (3, 4))


def test_truncated_shard_is_refused_naming_the_file(runs):
    ckpt = runs["disk_full_resumed"].dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"  # the resumed run saved step 4
    shard = ckpt / "global_step_4" / "actor" / "model_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = Run(runs["disk_full"].dir, ["trainer.total_training_steps=6"], name="truncated")
    assert r.finish() == 1
    paragraph = r.stderr.strip().splitlines()[-1]
    assert paragraph.startswith(f"Checkpoint error: cannot resume from {ckpt / 'global_step_4'}: {shard} is "), paragraph
    assert f"trainer.resume_from_path={ckpt / 'global_step_2'}" in paragraph
